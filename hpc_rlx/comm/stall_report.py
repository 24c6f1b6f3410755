"""The stall watchdog's report: what each rank was doing, and who a stalled collective waits
for. Pure code (no sockets, no MPI), unit-tested on made-up states."""

from __future__ import annotations

from hpc_rlx.base.topology import rank_span

__all__ = ["alive_and_busy", "at_step", "describe_state", "stall_report", "unreachable_hosts"]


def at_step(step) -> str:
    return "during startup" if step is None else f"at step {step}"


def describe_state(st: dict, now: float, silent_after: float) -> str:
    """One rank's last known state, as rank 0 sees it at time `now` (its own clock)."""
    age = now - st["recv"]
    if st.get("bye"):
        return f"has left training ({st.get('bye')})"
    if age > silent_after:
        return (f"silent: no heartbeat for {age:.1f} s (stuck in native code holding the "
                f"interpreter, or the process is gone)")
    if st.get("label") is not None:
        return f"waiting in '{st['label']}' {at_step(st.get('step'))} for {st['for'] + age:.1f} s"
    last = st.get("last")
    where = f"last left '{last[0]}' {at_step(last[1])}" if last else "has not reached any collective yet"
    now_at = "" if st.get("at") is None else f" at step {st['at']}"
    return f"busy outside any collective{now_at} for {st['for'] + age:.1f} s ({where})"


def stall_report(states: dict, size: int, now: float, warn_s: float, silent_after: float,
                 hosts: dict | None = None, root: tuple | None = None) -> tuple[str, tuple] | None:
    """The stall report, or None if no rank has waited `warn_s` in one collective.

    `states[rank]` is that rank's last heartbeat (see `StallWatchdog._heartbeat`), with the
    receive time `recv` on rank 0's clock. Returns (text, key) where key identifies the stalled
    collective, so a caller can report each stall once. `root` is rank 0's (address, port), named
    for ranks whose heartbeats never arrived.
    """
    hosts = hosts or {}
    waiting = []
    for r, st in states.items():
        # a silent rank's last word is stale: it shows up as silent, not as the one waiting
        if st.get("label") is not None and not st.get("bye") and now - st["recv"] <= silent_after:
            waited = st["for"] + (now - st["recv"])
            if waited >= warn_s:
                waiting.append((waited, r, st))
    if not waiting:
        return None
    waited, _, top = max(waiting, key=lambda t: (t[0], -t[1]))
    key = (top["label"], top.get("step"), top.get("seq"))
    arrived, missing = [], []
    for r in range(size):
        st = states.get(r)
        same = (st is not None and not st.get("bye") and st.get("label") == top["label"]
                and st.get("step") == top.get("step") and now - st["recv"] <= silent_after)
        (arrived if same else missing).append(r)
    lines = [f"hpc_rlx: STALL: collective '{top['label']}' {at_step(top.get('step'))} has waited "
             f"{waited:.1f} s (comm.stall_warning_s={warn_s:g})",
             f"hpc_rlx:   arrived ({len(arrived)}/{size}): ranks {rank_span(arrived)}",
             f"hpc_rlx:   not arrived ({len(missing)}/{size}): ranks {rank_span(missing)}"]
    cut = unreachable_hosts(states, size, now, silent_after, hosts)
    at = f" at {root[0]}:{root[1]}" if root else ""
    for r in missing[:32]:
        st = states.get(r)
        host = hosts.get(r, "?")
        if st and host in cut and not st.get("bye"):
            # the whole node is quiet: say that, not the one-process guess of describe_state
            what = (f"silent: no heartbeat for {now - st['recv']:.1f} s; unreachable: no rank on "
                    f"{host} is heard (network cut or node down)")
        elif st:
            what = describe_state(st, now, silent_after)
        else:
            # every rank started its watchdog before rank 0's listened (a collective start),
            # so a rank never heard is one whose heartbeats cannot get here, not one that is late
            what = (f"heartbeats cannot reach rank 0: none has arrived at its watchdog{at} (UDP "
                    f"blocked, or that address is not reachable from {host})")
            if host in cut:
                what += f"; unreachable: no rank on {host} is heard"
        lines.append(f"hpc_rlx:     rank {r} on {host}: {what}")
    if len(missing) > 32:
        lines.append(f"hpc_rlx:     ... and {len(missing) - 32} more")
    return "\n".join(lines), key


def _heard(st: dict | None, now: float, silent_after: float) -> bool:
    return st is not None and not st.get("bye") and now - st["recv"] <= silent_after


def unreachable_hosts(states: dict, size: int, now: float, silent_after: float, hosts: dict) -> set:
    """Hosts none of whose ranks is heard (silent or never heard, none of them gone with a
    goodbye): a node cut off or down, rather than one crashed process among live ones."""
    by_host: dict = {}
    for r in range(size):
        if r in hosts:
            by_host.setdefault(hosts[r], []).append(r)
    return {h for h, rs in by_host.items()
            if not any(_heard(states.get(r), now, silent_after) for r in rs)
            and not any((states.get(r) or {}).get("bye") for r in rs)}


def alive_and_busy(states: dict, now: float, silent_after: float) -> list[int]:
    """Ranks whose fresh heartbeat says they are working outside any collective (computing,
    checkpointing, validating, loading data): a job with any of them is slow, not stuck."""
    return sorted(r for r, st in states.items()
                  if _heard(st, now, silent_after) and st.get("label") is None)
