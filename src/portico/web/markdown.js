/**
 * A tiny, safe markdown renderer for model output.
 *
 * Safe by construction: it builds DOM nodes and sets only `textContent`, `href` (http,
 * https and mailto only) and class names, so no text the model writes can become markup,
 * a script or an event handler. Supported: paragraphs, `#`-headings, fenced code blocks,
 * `-`/`*`/`1.` lists, `>` quotes, inline code, **bold**, *italics* / _italics_,
 * [links](https://...) and bare https:// links. Anything else stays text.
 */

const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);

/** `href` for a link target, or null when it is not http(s)/mailto. */
export function safeHref(target) {
  try {
    const url = new URL(target);
    return SAFE_SCHEMES.has(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

// -- inline ---------------------------------------------------------------------------------

const INLINE = [
  { kind: "code", re: /`([^`\n]+)`/y },
  { kind: "link", re: /\[([^\]\n]+)\]\(([^)\s]+)\)/y },
  { kind: "url", re: /https?:\/\/[^\s<>()\]]+[^\s<>()\].,;:!?'"]/y },
  { kind: "strong", re: /\*\*(?=\S)([\s\S]+?\S)\*\*/y },
  { kind: "strong", re: /__(?=\S)([\s\S]+?\S)__/y },
  { kind: "em", re: /\*(?=[^\s*])([\s\S]*?[^\s*])\*/y },
  { kind: "em", re: /(?<![\w])_(?=\S)([\s\S]*?\S)_(?![\w])/y },
];
const SPECIAL = /[`[h*_]/g;

/** Append the inline markdown of `text` to `parent`. */
export function renderInline(text, parent) {
  let plain = "";
  let index = 0;
  const flush = () => {
    if (plain) parent.append(document.createTextNode(plain));
    plain = "";
  };
  while (index < text.length) {
    SPECIAL.lastIndex = index;
    const next = SPECIAL.exec(text);
    if (!next) break;
    plain += text.slice(index, next.index);
    index = next.index;
    let matched = false;
    for (const { kind, re } of INLINE) {
      re.lastIndex = index;
      const m = re.exec(text);
      if (!m) continue;
      matched = true;
      flush();
      if (kind === "code") {
        parent.append(el("code", null, m[1]));
      } else if (kind === "link" || kind === "url") {
        const label = kind === "link" ? m[1] : m[0];
        const href = safeHref(kind === "link" ? m[2] : m[0]);
        if (href) {
          const a = el("a");
          a.href = href;
          a.target = "_blank";
          a.rel = "noopener noreferrer nofollow";
          renderInline(label, a);
          parent.append(a);
        } else {
          renderInline(label, parent); // an unsafe target: keep the words, drop the link
        }
      } else {
        const node = el(kind);
        renderInline(m[1], node);
        parent.append(node);
      }
      index = re.lastIndex;
      break;
    }
    if (!matched) {
      plain += text[index];
      index += 1;
    }
  }
  plain += text.slice(index);
  flush();
}

// -- blocks ---------------------------------------------------------------------------------

const FENCE = /^\s*(```|~~~)\s*([\w+-]*)\s*$/;
const HEADING = /^(#{1,4})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;

/** Render `text` into a DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = String(text ?? "")
    .replace(/\r\n?/g, "\n")
    .split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(m[1])) body.push(lines[i++]);
      i += 1; // the closing fence (or the end of a reply still streaming)
      const pre = el("pre");
      const code = el("code", m[2] ? `language-${m[2]}` : null, body.join("\n"));
      pre.append(code);
      fragment.append(pre);
    } else if ((m = HEADING.exec(line))) {
      const heading = el(`h${m[1].length + 2}`);
      renderInline(m[2], heading);
      fragment.append(heading);
      i += 1;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const ordered = !BULLET.test(line);
      const pattern = ordered ? NUMBERED : BULLET;
      const list = el(ordered ? "ol" : "ul");
      if (ordered) list.start = Number(NUMBERED.exec(line)[1]);
      while (i < lines.length && pattern.test(lines[i])) {
        const item = el("li");
        const groups = pattern.exec(lines[i]);
        renderInline(groups[groups.length - 1], item);
        list.append(item);
        i += 1;
      }
      fragment.append(list);
    } else if (QUOTE.test(line)) {
      const quote = el("blockquote");
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(QUOTE.exec(lines[i++])[1]);
      quote.append(renderMarkdown(body.join("\n")));
      fragment.append(quote);
    } else {
      const paragraph = el("p");
      const body = [];
      while (
        i < lines.length &&
        lines[i].trim() &&
        !FENCE.test(lines[i]) &&
        !HEADING.test(lines[i]) &&
        !BULLET.test(lines[i]) &&
        !NUMBERED.test(lines[i]) &&
        !QUOTE.test(lines[i])
      ) {
        body.push(lines[i++]);
      }
      body.forEach((part, index) => {
        if (index) paragraph.append(el("br"));
        renderInline(part, paragraph);
      });
      fragment.append(paragraph);
    }
  }
  return fragment;
}
