"""The room a rank has for its shard (`data.memory_room`), from made-up /proc and cgroup trees:
cgroup v2 and v1, a container's partial mount, limits on a parent, no limit at all."""

from __future__ import annotations

from pathlib import Path

from hpc_rlx.data import memory_room as mr

MIB = 1 << 20
V1_NO_LIMIT = 9223372036854771712


def _proc(tmp: Path, cgroup: str, mountinfo: list[str], avail_kib: int | None = 4 << 20) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self/cgroup").write_text(cgroup)
    (proc / "self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    (proc / "meminfo").write_text("MemTotal: 99999999 kB\n"
                                  + ("" if avail_kib is None else f"MemAvailable: {avail_kib} kB\n"))
    return proc


def _files(d: Path, **files) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(str(text))


def test_v2_the_tightest_limit_on_the_way_up_less_what_is_in_use(tmp_path):
    root = tmp_path / "cg"
    _files(root / "job", memory_max=1024 * MIB, memory_current=100 * MIB)
    _files(root / "job/step", memory_max="max", memory_current=90 * MIB,
           memory_stat=f"anon 1\ninactive_file {40 * MIB}\n")
    proc = _proc(tmp_path, "0::/job/step\n", [f"40 31 0:38 / {root} rw - cgroup2 cgroup2 rw"])
    room, what = mr.cgroup_room(proc)
    assert room == 924 * MIB and f"cgroup {root / 'job'}: 1.0 GiB, 100.0 MiB in use" in what
    # a tighter limit below wins; inactive page cache does not count as in use
    _files(root / "job/step", memory_max=256 * MIB)
    assert mr.cgroup_room(proc)[0] == (256 - 50) * MIB


def test_v1_with_a_containers_mount_of_part_of_the_hierarchy(tmp_path):
    point = tmp_path / "memory"
    # the container sees its own cgroup as the mount's root
    _files(point, memory_limit_in_bytes=512 * MIB, memory_usage_in_bytes=200 * MIB,
           memory_stat=f"total_inactive_file {100 * MIB}\n")
    proc = _proc(tmp_path, "4:memory:/docker/abc\n0::/\n",
                 [f"35 31 0:32 /docker/abc {point} rw - cgroup cgroup rw,memory",
                  f"36 31 0:33 / {tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu"])
    assert mr.cgroup_room(proc)[0] == (512 - 100) * MIB


def test_no_limit_is_the_nodes_available_memory_shared_by_its_ranks(tmp_path):
    point = tmp_path / "memory"
    _files(point, memory_limit_in_bytes=V1_NO_LIMIT, memory_usage_in_bytes=200 * MIB)
    proc = _proc(tmp_path, "4:memory:/\n", [f"35 31 0:32 / {point} rw - cgroup cgroup rw,memory"],
                 avail_kib=4 << 20)
    assert mr.cgroup_room(proc) is None
    room = mr.rank_room(4, "n7", proc)
    assert room == mr.Room(1 << 30, "n7's available memory: 4.0 GiB, shared by its 4 ranks on n7")
    # a limit above the node's available memory does not make more room
    _files(point, memory_limit_in_bytes=64 << 30)
    assert mr.rank_room(1, "n7", proc).bytes == 4 << 30
    assert mr.rank_room(2, "n7", _proc(tmp_path / "none", "", [], avail_kib=None)) is None


def test_a_shard_fits_with_its_margin_or_the_message_says_what_to_do():
    room = mr.Room(200 * MIB, "the memory limit of cgroup /x: 400.0 MiB, 0.0 MiB in use, shared by its 2 ranks on n1")
    assert mr.shard_problem(160 * MIB, room, "rows", "d.h5") is None
    assert mr.shard_problem(10 << 30, None, "rows", "d.h5") is None        # nothing measured: no refusal
    text = mr.shard_problem(190 * MIB, room, "1,000 training rows of 8 bytes", "d.h5")
    assert text.startswith("this rank's shard of d.h5 (1,000 training rows of 8 bytes) takes 190.0 MiB of "
                           "memory with data.cache=memory (225.0 MiB with read buffers), more than the "
                           "200.0 MiB the rank may use (the memory limit of cgroup /x")
    assert "data.cache=stream trains the same file" in text
