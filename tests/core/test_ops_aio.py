"""async_io (DeepNVMe aio_handle): round trips on every engine (native libaio, native thread
pool, pure-Python fallback), many files, concurrent handles, async + wait, and error messages."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsplug.op_builder import AsyncIOBuilder, native_disabled
from dsplug.ops.native.aio import AsyncIOModule

HYPOTHESIS = settings(max_examples=25, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def native_ops():
    builder = AsyncIOBuilder()
    why = "DSPLUG_DISABLE_NATIVE_OPS is set" if native_disabled() else builder.incompatibility()
    if why:
        pytest.skip(f"async_io cannot be built here: {why}")
    return builder.load(fallback=False)


@pytest.fixture(scope="module", params=["libaio", "threads", "python"])
def make_handle(request, native_ops):
    """Factory of handles on one engine: native libaio, native thread pool, or the fallback."""
    if request.param == "python":
        ops, backend = AsyncIOModule(None), None
    else:
        if request.param == "libaio" and not native_ops.libaio_compiled:
            pytest.skip("libaio.h was not found when async_io was built")
        ops, backend = native_ops, request.param
    def make(**kwargs):
        h = ops.aio_handle(backend=backend, **kwargs) if backend else ops.aio_handle(**kwargs)
        assert h.backend == request.param
        return h
    make.engine = request.param
    return make


def _random_tensor(nbytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype) if nbytes % torch.empty(0, dtype=dtype).element_size() == 0 else raw


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes viewed as floats contain NaNs, which torch.equal rejects)."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


sizes = st.one_of(st.integers(0, 9000), st.sampled_from([4096, 8192, 65536, 1 << 20, (1 << 20) + 4096, 3 * 4096 + 1]),
                  st.integers(1 << 18, 3 << 20))


@HYPOTHESIS
@given(nbytes=sizes, dtype=st.sampled_from([torch.uint8, torch.float32, torch.bfloat16, torch.int64]),
       locked=st.booleans(), offset=st.sampled_from([0, 4096, 100]), block=st.sampled_from([4096, 65536, 1 << 20, 1000]),
       parallelism=st.sampled_from([1, 2, 3]), depth=st.sampled_from([1, 4, 128]), single=st.booleans(),
       overlap=st.booleans(), seed=st.integers(0, 1000))
def test_round_trip(make_handle, tmp_path, nbytes, dtype, locked, offset, block, parallelism, depth, single, overlap,
                    seed):
    h = make_handle(block_size=block, queue_depth=depth, single_submit=single, overlap_events=overlap,
                    intra_op_parallelism=parallelism)
    src = _random_tensor(nbytes, dtype, seed)
    if locked:  # 4 KiB-aligned memory: the O_DIRECT path
        aligned = h.new_cpu_locked_tensor(src.numel(), src)
        assert aligned.data_ptr() % 4096 == 0 and aligned.dtype == src.dtype
        aligned.copy_(src)
        src = aligned
    path = tmp_path / f"t{seed}.bin"
    path.write_bytes(b"\xab" * offset)  # data before the offset must survive
    assert h.async_pwrite(src, str(path), offset) == 0
    assert h.wait() == 1
    data = path.read_bytes()
    assert len(data) == offset + nbytes and data[:offset] == b"\xab" * offset
    assert data[offset:] == src.reshape(-1).view(torch.uint8).numpy().tobytes()
    dst = torch.empty_like(src) if not locked else h.new_cpu_locked_tensor(src.numel(), src)
    assert h.sync_pread(dst, path, offset) == 1
    assert same_bytes(dst, src)
    if locked:
        assert h.free_cpu_locked_tensor(dst) and h.free_cpu_locked_tensor(src)


def test_many_files_async_then_one_wait(make_handle, tmp_path):
    h = make_handle(intra_op_parallelism=2, queue_depth=8)
    tensors = [_random_tensor(n, torch.uint8, n) for n in [1, 4095, 4096, 4097, 12345, 1 << 16, 200_000] * 3]
    for i, t in enumerate(tensors):
        h.async_pwrite(t, tmp_path / f"f{i}.bin")
    assert h.wait() == len(tensors)
    assert h.wait() == 0  # nothing pending any more
    back = [torch.empty_like(t) for t in tensors]
    for i, b in enumerate(back):
        assert h.async_pread(b, tmp_path / f"f{i}.bin") == 0
    assert h.wait() == len(tensors)
    for t, b in zip(tensors, back):
        assert same_bytes(t, b)


def test_concurrent_handles(make_handle, tmp_path):
    errors = []

    def worker(k):
        try:
            h = make_handle(intra_op_parallelism=2, block_size=65536)
            for j in range(4):
                t = _random_tensor(100_000 + 4096 * j + k, torch.uint8, 10 * k + j)
                path = tmp_path / f"w{k}_{j}.bin"
                h.async_pwrite(t, path)
                h.wait()
                back = torch.empty_like(t)
                h.sync_pread(back, path)
                assert same_bytes(back, t)
        except Exception as err:  # surfaced below with the thread's context
            errors.append((k, repr(err)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_deepspeed_call_forms(make_handle, tmp_path):
    h = make_handle(block_size=8192, queue_depth=16, single_submit=True, overlap_events=True, intra_op_parallelism=3)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (8192, 16, True, True, 3)
    t = _random_tensor(50_000, torch.float32, 1)
    path = str(tmp_path / "ds.bin")
    assert h.pwrite(t, path, True, False) == 1  # (buffer, filename, validate, async) blocking
    assert h.pwrite(t, path, False, True) == 0 and h.wait() == 1
    back = torch.empty_like(t)
    assert h.pread(back, path, True, **{"async": True}) == 0  # DeepSpeed's keyword name
    assert h.wait() == 1 and same_bytes(back, t)
    back.zero_()
    assert h.read(back, path) == 0 and same_bytes(back, t)
    assert h.write(t, tmp_path / "w.bin", True) == 0
    assert (tmp_path / "w.bin").read_bytes() == t.numpy().tobytes()
    assert h.sync_pwrite(t, path) == 1 and h.sync_pread(back, path) == 1


def test_offset_writes_compose_one_file(make_handle, tmp_path):
    h = make_handle(intra_op_parallelism=2)
    whole = _random_tensor(3 * 65536, torch.uint8, 7)
    path = tmp_path / "parts.bin"
    for k in (2, 0, 1):  # three aligned parts of one file, written asynchronously out of order
        part = whole[k * 65536:(k + 1) * 65536]
        h.async_pwrite(part, path, k * 65536)
    assert h.wait() == 3
    back = torch.empty_like(whole)
    h.sync_pread(back, path)
    assert same_bytes(back, whole)
    tail = torch.empty(65536, dtype=torch.uint8)
    h.sync_pread(tail, path, 2 * 65536)
    assert same_bytes(tail, whole[2 * 65536:])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="fd= reopens through /proc/self/fd (Linux)")
def test_open_file_descriptors_as_deepspeed_passes_them(make_handle, tmp_path):
    """DeepSpeed's fd= form: the caller opens the file (O_DIRECT here, as DeepSpeed's tests do);
    parts written through the descriptor at their offsets read back through another one."""
    h = make_handle()
    whole = _random_tensor(2 * 65536, torch.uint8, 11)
    path = tmp_path / "by_fd.bin"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    try:
        for k in (1, 0):
            h.async_pwrite(buffer=whole[k * 65536:(k + 1) * 65536], fd=fd, file_offset=k * 65536)
        assert h.wait() == 2
    finally:
        os.close(fd)
    assert path.read_bytes() == whole.numpy().tobytes()
    back = torch.empty_like(whole)
    fd = os.open(path, os.O_RDONLY)
    try:
        h.sync_pread(back, fd=fd)
        with pytest.raises(TypeError, match="filename= or fd=, not both"):
            h.async_pread(back, path, fd=fd)
    finally:
        os.close(fd)
    assert same_bytes(back, whole)
    with pytest.raises(TypeError, match=r"filename= \(a path\) or fd="):
        h.sync_pwrite(whole)
    with pytest.raises(OSError, match="not an open file descriptor"):
        h.sync_pwrite(whole, fd=10 ** 6)  # above any descriptor limit: never open
    with pytest.raises(ValueError, match="fd must be an open file descriptor"):
        h.sync_pwrite(whole, fd=-1)


def test_errors_name_the_file_and_sizes(make_handle, tmp_path):
    h = make_handle()
    t = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
    missing_dir = tmp_path / "no" / "such" / "dir"
    with pytest.raises(FileNotFoundError, match=r"cannot write 4000 bytes: directory '.*no/such/dir' does not exist") as e:
        h.async_pwrite(t, missing_dir / "x.bin")
    assert e.value.filename == str(missing_dir / "x.bin")
    with pytest.raises(FileNotFoundError, match="cannot read 4000 bytes into the tensor: no such file") as e:
        h.sync_pread(t, tmp_path / "absent.bin")
    assert e.value.filename == str(tmp_path / "absent.bin")
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 3000)
    with pytest.raises(EOFError, match=r"cannot read 4000 bytes at offset 0 from '.*small.bin': the file has only "
                                       r"3000 bytes, so the read would go 1000 bytes past its end"):
        h.sync_pread(t, small)
    with pytest.raises(EOFError, match=r"4000 bytes at offset 2000 .* only 3000 bytes"):
        h.async_pread(t, small, 2000)
    with pytest.raises(IsADirectoryError):
        h.sync_pwrite(t, tmp_path)
    with pytest.raises(ValueError, match="buffer must be contiguous"):
        h.sync_pwrite(torch.zeros(10, 2)[:, 0], tmp_path / "nc.bin")
    with pytest.raises(ValueError, match="buffer must be on the CPU, got device meta"):
        h.sync_pwrite(torch.zeros(4, device="meta"), tmp_path / "meta.bin")
    with pytest.raises(TypeError, match="buffer must be a torch.Tensor, got bytes"):
        h.sync_pwrite(b"abc", tmp_path / "b.bin")
    with pytest.raises(ValueError, match="file_offset must be a non-negative integer, got -1"):
        h.sync_pwrite(t, tmp_path / "o.bin", -1)
    assert h.wait() == 0  # nothing was queued by the failed calls


def test_engine_reports_read_past_end_at_wait(make_handle, tmp_path):
    """A file that shrinks after the checks: the engine itself reports end of file, at wait()."""
    h = make_handle(intra_op_parallelism=2, block_size=4096)
    t = h.new_cpu_locked_tensor(5 * 4096, torch.empty(0, dtype=torch.uint8))
    path = tmp_path / "shrunk.bin"
    path.write_bytes(b"\0" * (3 * 4096 + 5))
    code, message = h._engine.submit(True, t.data_ptr(), t.numel(), str(path), 0)  # bypass the size check
    assert code == 0
    count, errors = h._engine.wait()
    assert count == 1 and len(errors) == 1
    code, message = errors[0]
    assert code == -1 and "hit the end of the file" in message and "shrunk.bin" in message


def test_handle_argument_errors(native_ops):
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        native_ops.aio_handle(block_size=0)
    with pytest.raises(ValueError, match="intra_op_parallelism must be a positive integer, got -2"):
        native_ops.aio_handle(intra_op_parallelism=-2)
    with pytest.raises(ValueError, match="backend 'spdk' is not valid; choose one of auto, libaio, threads"):
        native_ops.aio_handle(backend="spdk")


def test_drop_in_import_paths(tmp_path):
    from dsplug.ops import aio as ds_aio
    from dsplug.ops.op_builder import AsyncIOBuilder as FromOps

    assert FromOps is AsyncIOBuilder is ds_aio.AsyncIOBuilder
    h = FromOps().load().aio_handle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (1048576, 128, False, False, 1)
    t = torch.arange(1000, dtype=torch.int32)
    h.sync_pwrite(t, tmp_path / "a.bin")
    back = torch.empty_like(t)
    ds_aio.aio_handle().sync_pread(back, tmp_path / "a.bin")
    assert same_bytes(back, t)


def test_native_and_fallback_files_are_interchangeable(native_ops, tmp_path):
    fast, slow = native_ops.aio_handle(), AsyncIOModule(None).aio_handle()
    t = _random_tensor(123_457, torch.uint8, 3)
    fast.sync_pwrite(t, tmp_path / "n.bin")
    slow.sync_pwrite(t, tmp_path / "p.bin")
    assert (tmp_path / "n.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    a, b = torch.empty_like(t), torch.empty_like(t)
    slow.sync_pread(a, tmp_path / "n.bin")
    fast.sync_pread(b, tmp_path / "p.bin")
    assert same_bytes(a, t) and same_bytes(b, t)


def test_nvme_tune_prints_a_config_block(native_ops, tmp_path, capsys):
    import json

    from dsplug.cli import main

    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["64K", "128K"], "queue_depth": [4], "io_parallel": [1, 2],
                                 "single_submit": [False], "overlap_events": [True]}))
    code = main(["nvme-tune", "--nvme_dir", str(tmp_path), "--io_size", "1M", "--sweep_config", str(sweep),
                 "--verbose"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 configurations" in out and out.count("GB/s  {") == 4
    rates = out.split("Best performance (GB/sec): ")[1].split("\n")[0]
    assert rates.startswith("read = ") and ", write = " in rates
    block = json.loads(out[out.index("{\n"):])
    assert set(block["aio"]) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"}
    assert block["aio"]["block_size"] in (65536, 131072) and block["aio"]["queue_depth"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("_dsplug_aio_tune")]  # cleaned up


def test_nvme_tune_rejects_bad_arguments(tmp_path, capsys):
    from dsplug.cli import main

    assert main(["nvme-tune", "--nvme_dir", str(tmp_path / "missing")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err
    assert main(["nvme-tune", "--nvme_dir", str(tmp_path), "--block_size", "12Q"]) == 2
    assert "invalid size '12Q'" in capsys.readouterr().err
    assert main(["nvme-tune", "--nvme_dir", str(tmp_path), "--queue_depth", "0"]) == 2
    assert "queue_depth values must be positive" in capsys.readouterr().err
