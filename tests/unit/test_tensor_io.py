"""Direct-I/O checkpoint files (DeepSpeed's async I/O on the real filesystem) and the store's
deferred commit: bytes on disk, checksums, and a later write that must not change a capture."""

import hashlib
import json
import threading

import pytest
import torch

from spillway_runtime.checkpoints.store import CheckpointStore
from spillway_runtime.checkpoints.tensor_io import (
    BLOCK_HASH,
    DirectIO,
    TensorRef,
    chunked_digest,
    combine,
    join_state,
    refs_in,
    split_state,
)

CHUNK = 64 << 10  # small chunks: many of them, and tails, in small files


@pytest.fixture(params=[True, False], ids=["direct", "page-cache"])
def io(request):
    """Direct I/O, and the page-cache path used where RLIMIT_MEMLOCK leaves no locked buffers."""
    io = DirectIO(chunk=CHUNK, direct=request.param)
    yield io
    io.close()


def expected_digest(data: bytes, chunk: int = CHUNK) -> str:
    return combine([hashlib.sha256(data[i:i + chunk]).digest() for i in range(0, len(data), chunk)])


@pytest.mark.parametrize("sizes", [[1], [4096], [CHUNK], [CHUNK + 1], [3, CHUNK * 3 + 17, 5000], [CHUNK * 2, 0, 1]])
def test_tensors_are_written_back_to_back_byte_for_byte(io, tmp_path, sizes):
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    written = io.write_tensors(tmp_path / "t", tensors)
    data = b"".join(t.numpy().tobytes() for t in tensors)
    assert (tmp_path / "t").read_bytes() == data
    assert written.size == len(data)
    assert written.digest == expected_digest(data) == chunked_digest(tmp_path / "t", CHUNK)
    back = [torch.empty_like(t) for t in tensors]
    assert io.read_into(tmp_path / "t", back) == written.digest
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))


def test_bf16_views_and_strided_tensors_keep_their_bits(io, tmp_path):
    base = torch.randn(70_001, dtype=torch.float32).to(torch.bfloat16)
    strided = torch.randn(300, 200)[:, ::3]
    tensors = [base, base[5:60_000], strided, torch.tensor([-0.0])]
    io.write_tensors(tmp_path / "t", tensors)
    back = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    io.read_into(tmp_path / "t", back)
    for got, want in zip(back, tensors, strict=True):
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))


def test_copy_and_digest_match_the_source(io, tmp_path):
    data = bytes(range(256)) * (CHUNK * 5 // 256) + b"tail"
    (tmp_path / "src").write_bytes(data)
    copied = io.copy_file(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == data
    assert copied.digest == io.digest(tmp_path / "src") == expected_digest(data)


def test_a_long_file_is_read_in_order_through_the_read_ahead_buffers(io, tmp_path):
    data = torch.randint(0, 256, (CHUNK * 11 + 4097,), dtype=torch.uint8)
    pieces = [data[:CHUNK * 3 + 5], data[CHUNK * 3 + 5:]]  # a tensor ends inside a chunk
    written = io.write_tensors(tmp_path / "t", pieces)
    back = [torch.empty_like(p) for p in pieces]
    assert io.read_into(tmp_path / "t", back) == written.digest == expected_digest(data.numpy().tobytes())
    assert torch.equal(torch.cat(back), data)
    seen = io.read_chunks(tmp_path / "t", data.numel(), lambda offset, chunk: offset.to_bytes(8, "big") + chunk.numpy().tobytes())
    assert [int.from_bytes(s[:8], "big") for s in seen] == list(range(0, data.numel(), CHUNK))
    assert b"".join(s[8:] for s in seen) == data.numpy().tobytes()


def test_a_failing_reader_of_a_chunk_stops_the_read_and_leaves_the_instance_working(io, tmp_path):
    (tmp_path / "t").write_bytes(b"x" * (CHUNK * 9))

    def consume(offset, chunk):
        if offset == CHUNK * 5:
            raise ValueError("bad chunk")
        return b""

    with pytest.raises(ValueError, match="bad chunk"):
        io.read_chunks(tmp_path / "t", CHUNK * 9, consume)
    assert io.digest(tmp_path / "t") == expected_digest(b"x" * (CHUNK * 9))


def test_reading_a_file_of_another_size_is_refused(io, tmp_path):
    (tmp_path / "t").write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="holds 100 bytes, 200 expected"):
        io.read_into(tmp_path / "t", [torch.empty(200, dtype=torch.uint8)])


def test_split_state_copies_small_values_and_refers_to_large_tensors_once():
    big = torch.randn(1 << 19)  # 2 MiB
    small = torch.randn(4)
    scale = {"cur_scale": 1.0}
    state = {"a": big, "b": [big, small], "scale": scale, "t": (1, "x")}
    skeleton, tensors = split_state(state)
    assert tensors == [big] or (len(tensors) == 1 and tensors[0] is big)
    assert skeleton["a"] == skeleton["b"][0] == TensorRef(0, big.numel() * 4, "float32", (1 << 19,))
    scale["cur_scale"] = 2.0  # a later change of the live state does not reach the capture
    small.add_(1)
    assert skeleton["scale"]["cur_scale"] == 1.0
    assert not torch.equal(skeleton["b"][1], small)
    assert refs_in(skeleton) == [skeleton["a"]]
    joined = join_state(skeleton, {0: big.clone()})
    assert torch.equal(joined["a"], big) and joined["t"] == (1, "x")


def deferred_writer(io, payload: torch.Tensor, release: threading.Event):
    """A save whose tensor is written in a thread once `release` is set, as training does."""
    def save(staging):
        (staging / "small.json").write_text("{}")
        result = {}

        def run():
            release.wait()
            result["w"] = io.write_tensors(staging / "big.tensors", [payload])

        thread = threading.Thread(target=run)
        thread.start()

        def wait():
            thread.join()
            w = result["w"]
            return [(w.path, w.size, w.digest)]
        return wait
    return save


def test_a_begun_checkpoint_is_committed_only_when_finished_with_the_written_checksums(io, tmp_path):
    store = CheckpointStore(tmp_path, keep=2, digest=io.digest)
    payload = torch.randint(0, 256, (CHUNK * 3 + 5,), dtype=torch.uint8)
    release = threading.Event()
    pending = store.begin(7, deferred_writer(io, payload, release), {"loss": 0.5})
    assert store.list() == [] and not (tmp_path / "latest").exists()
    release.set()
    info = store.finish(pending)
    assert info.name == "step-00000007" and (tmp_path / "latest").read_text() == info.name
    manifest = json.loads((info.path / "manifest.json").read_text())
    entry = manifest["files"]["big.tensors"]
    assert entry == {"sha256": expected_digest(payload.numpy().tobytes()), "size": payload.numel(), "hash": BLOCK_HASH}
    assert not [p for p in info.path.iterdir() if p.name.startswith(".digests")]
    assert store.verify(info.path) is None


def test_a_damaged_tensor_file_fails_a_deep_check_and_is_left_to_the_reader_otherwise(io, tmp_path):
    store = CheckpointStore(tmp_path, keep=2, digest=io.digest)
    payload = torch.randint(0, 256, (CHUNK * 2,), dtype=torch.uint8)
    release = threading.Event()
    release.set()
    info = store.finish(store.begin(1, deferred_writer(io, payload, release), {}))
    data = bytearray((info.path / "big.tensors").read_bytes())
    data[CHUNK + 3] ^= 1  # one bit, in the second chunk
    (info.path / "big.tensors").write_bytes(bytes(data))
    assert store.verify(info.path) == "big.tensors does not match its checksum"
    assert store.verify(info.path, deep=False) is None
    assert store.deferred(info.path) == {(info.path / "big.tensors").resolve(): expected_digest(payload.numpy().tobytes())}


@pytest.mark.parametrize(("memlock", "direct", "chunk"), [
    (None, True, 32 << 20), (2 << 30, True, 32 << 20),  # two to write, four to read: six locked buffers
    (1 << 30, True, (1 << 30) * 15 // 100 // 6 // 4096 * 4096), (64 << 20, True, (64 << 20) * 15 // 100 // 6 // 4096 * 4096),
    (8 << 20, False, 1 << 20),  # a pod's default: 8 MiB, three quarters of it the optimizer swapper's
])
def test_locked_buffers_fit_under_rlimit_memlock(memlock, direct, chunk, tmp_path):
    from spillway_runtime.checkpoints.engine import direct_io
    from spillway_runtime.core.hardware import AioSettings

    io = direct_io(AioSettings(), memlock, tmp_path)
    try:
        assert (io.direct, io.chunk) == (direct, chunk)
        if direct and memlock:
            assert 6 * io.chunk <= memlock * 0.15
    finally:
        io.close()


def test_deepspeeds_files_round_trip_through_the_checkpoint_engine_now_or_in_the_background(io, tmp_path):
    from spillway_runtime.checkpoints.engine import BackgroundWrite, SpillwayCheckpointEngine
    from spillway_runtime.checkpoints.tensor_io import CheckpointIOError

    engine = SpillwayCheckpointEngine(io)
    state = {"fp32_groups": [torch.randn(300_000), torch.randn(10)], "step": 7, "scaler": {"scale": 1.0}}
    engine.save(state, str(tmp_path / "now.pt"))  # outside `deferring`: written before it returns
    assert (tmp_path / "now.pt.tensors").stat().st_size == 300_000 * 4 and not engine.take_jobs()
    with engine.deferring():
        engine.save(state, str(tmp_path / "later.pt"))
    assert not (tmp_path / "later.pt.tensors").exists()
    jobs = engine.take_jobs()
    [written] = BackgroundWrite(io, jobs).wait()
    for name in ("now.pt", "later.pt"):
        back = engine.load(str(tmp_path / name))
        assert back["step"] == 7 and back["scaler"] == {"scale": 1.0}
        assert all(torch.equal(a, b) for a, b in zip(back["fp32_groups"], state["fp32_groups"], strict=True))
    engine.expected = {written.path.resolve(): "0" * 64}
    with pytest.raises(CheckpointIOError, match=r"later\.pt\.tensors does not match its checksum"):
        engine.load(str(tmp_path / "later.pt"))


def test_a_node_whose_async_io_op_does_not_load_still_writes_checkpoints(monkeypatch, tmp_path):
    """Seen on the GPU kit's first H200 run: the image's TORCH_CUDA_ARCH_LIST ("...9.0a") broke
    DeepSpeed's JIT build of async_io, and every checkpoint of an optimizer-on-CPU run died with
    it. The build's failure is the one thing faked here (this machine's op loads)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    def broken(self, verbose=True):
        raise ValueError("invalid literal for int() with base 10: '0a'")

    monkeypatch.setattr(AsyncIOBuilder, "load", broken)
    io = DirectIO(chunk=CHUNK, direct=True)
    try:
        assert not io.direct and "async_io op did not load (ValueError: invalid literal" in io.fallback
        data = torch.randint(0, 256, (CHUNK * 2 + 7,), dtype=torch.uint8)
        written = io.write_tensors(tmp_path / "t", [data])
        assert (tmp_path / "t").read_bytes() == data.numpy().tobytes()
        back = torch.empty_like(data)
        assert io.read_into(tmp_path / "t", [back]) == written.digest and torch.equal(back, data)
    finally:
        io.close()
