// The microphone's AudioWorklet (portico.js `Microphone`): mixes the input to mono,
// resamples it to the call's rate (linear interpolation, the rate a `session_config`
// names arrives as a port message) and posts pcm16 little-endian frames of `frameMs`.
// Served from the page's own origin: the CSP's `script-src 'self'` covers worklets.

class PorticoCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { rate = 16000, frameMs = 20 } = options.processorOptions ?? {};
    this.frameMs = frameMs;
    this.setRate(rate);
    this.previous = 0; // the last input sample of the block before
    this.position = 0; // where the next output sample falls, in input samples from this block
    this.port.onmessage = (event) => {
      if (event.data?.rate) this.setRate(event.data.rate);
    };
  }

  setRate(rate) {
    this.rate = rate;
    this.step = sampleRate / rate; // input samples per output sample
    this.frame = new Int16Array(Math.round((rate * this.frameMs) / 1000));
    this.filled = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true;
    const n = channels[0].length;
    const mono = channels.length === 1 ? channels[0] : new Float32Array(n);
    if (channels.length > 1) {
      for (const channel of channels) for (let i = 0; i < n; i++) mono[i] += channel[i] / channels.length;
    }
    // Position -1 is `previous`: interpolation spans the boundary between blocks.
    while (this.position < n - 1) {
      const i = Math.floor(this.position);
      const fraction = this.position - i;
      const a = i < 0 ? this.previous : mono[i];
      const value = a + (mono[i + 1] - a) * fraction;
      this.push(value);
      this.position += this.step;
    }
    this.position -= n;
    this.previous = mono[n - 1];
    return true;
  }

  push(value) {
    const clipped = Math.max(-1, Math.min(1, value));
    this.frame[this.filled++] = clipped < 0 ? clipped * 32768 : clipped * 32767;
    if (this.filled === this.frame.length) {
      const out = this.frame;
      this.frame = new Int16Array(out.length);
      this.filled = 0;
      this.port.postMessage(out.buffer, [out.buffer]);
    }
  }
}

registerProcessor("portico-capture", PorticoCapture);
