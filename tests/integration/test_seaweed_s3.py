"""SeaweedFS as the `media: s3` tests' object store: presigned PUT, size bound, HEAD.

What S3 enforces on a presigned PUT decides what `confirm-upload` must check
(docs/storage.md): these pin it against the real store.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed

aiobotocore_session = pytest.importorskip("aiobotocore.session")
BUCKET = "portico-media"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    server = Seaweed(Path(tmp_path_factory.mktemp("seaweed")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def s3(seaweed: Seaweed) -> AsyncIterator[Any]:
    session = aiobotocore_session.get_session()
    async with session.create_client(
        "s3",
        endpoint_url=seaweed.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    ) as client:
        with contextlib.suppress(client.exceptions.ClientError):  # an earlier test made it
            await client.create_bucket(Bucket=BUCKET)
        yield client


async def test_a_presigned_put_stores_the_object_with_its_size_and_type(s3: Any) -> None:
    params = {"Bucket": BUCKET, "Key": "k1", "ContentLength": 5, "ContentType": "text/plain"}
    url = await s3.generate_presigned_url("put_object", Params=params, ExpiresIn=60)
    headers = {"Content-Type": "text/plain"}
    async with aiohttp.ClientSession() as http, http.put(url, data=b"hello", headers=headers) as r:
        assert r.status == 200
    head = await s3.head_object(Bucket=BUCKET, Key="k1")
    assert head["ContentLength"] == 5
    assert head["ContentType"] == "text/plain"


async def test_a_store_may_take_a_body_longer_than_signed_so_confirm_must_check(s3: Any) -> None:
    """With botocore's default presigning (SigV2 query auth for S3), Content-Length is
    not signed and SeaweedFS takes a longer body (AWS refuses it with 403).

    So the size limit cannot rest on the signature alone: confirm-upload reads
    the object's real size (HEAD) and deletes one that is not the declared size.
    """
    params = {"Bucket": BUCKET, "Key": "k2", "ContentLength": 5, "ContentType": "text/plain"}
    url = await s3.generate_presigned_url("put_object", Params=params, ExpiresIn=60)
    headers = {"Content-Type": "text/plain"}
    async with aiohttp.ClientSession() as http, http.put(url, data=b"hello!", headers=headers) as r:
        status = r.status
    head = await s3.head_object(Bucket=BUCKET, Key="k2")
    assert (status, head["ContentLength"]) == (200, 6)


async def test_a_sigv4_presigned_put_signs_the_length_and_type(seaweed: Seaweed) -> None:
    """The S3 media store presigns with SigV4 (`media/s3.py`): SeaweedFS then refuses a
    body of another length or type itself, and confirm-upload's check is a second line."""
    from botocore.config import Config

    session = aiobotocore_session.get_session()
    config = Config(signature_version="s3v4", s3={"addressing_style": "path"})
    async with session.create_client(
        "s3",
        endpoint_url=seaweed.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=config,
    ) as client:
        with contextlib.suppress(client.exceptions.ClientError):
            await client.create_bucket(Bucket=BUCKET)
        params = {"Bucket": BUCKET, "Key": "k3", "ContentLength": 5, "ContentType": "text/plain"}
        url = await client.generate_presigned_url("put_object", Params=params, ExpiresIn=60)
        statuses = []
        async with aiohttp.ClientSession() as http:
            for body, mime_type in [(b"hello!", "text/plain"), (b"hello", "text/html")]:
                async with http.put(url, data=body, headers={"Content-Type": mime_type}) as r:
                    statuses.append(r.status)
            async with http.put(url, data=b"hello", headers={"Content-Type": "text/plain"}) as r:
                statuses.append(r.status)
    assert statuses == [403, 403, 200]


async def test_media_a_replica_produces_is_read_on_another(seaweed: Seaweed) -> None:
    """Streamed media the engine archives (`MediaService.keep`, e.g. the demo's `beep`)
    goes through the port's `write`: another replica on the bucket reads and serves it."""
    from portico.media.s3 import S3MediaStore
    from portico.media.service import MediaService
    from portico.store.memory import MemoryStore

    def replica(holder: str) -> MediaService:
        store = S3MediaStore(
            bucket="portico-produced",
            endpoint_url=seaweed.endpoint_url,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            holder=holder,
        )
        return MediaService(store, archive=MemoryStore())

    first, second = replica("replica-1"), replica("replica-2")
    await first.open()
    await second.open()
    try:
        sound = b"RIFF" + bytes(range(256)) * 40
        part = await first.keep(
            principal="alice",
            session_id="s1",
            mime_type="audio/wav",
            data=sound,
            filename="beep.wav",
        )
        assert part is not None
        assert part.storage_ref is not None
        assert await second.read(session_id="s1", media=part) == sound
        media_id = part.storage_ref.rsplit("/", 1)[1]
        info, body = await second.download(principal="alice", session_id="s1", media_id=media_id)
        assert isinstance(body, str)  # a presigned URL: the bucket serves the bytes
        async with aiohttp.ClientSession() as http, http.get(body) as response:
            assert (response.status, await response.read()) == (200, sound)
        assert (info.owner, info.mime_type, info.size_bytes) == ("alice", "audio/wav", len(sound))
    finally:
        await first.close()
        await second.close()
