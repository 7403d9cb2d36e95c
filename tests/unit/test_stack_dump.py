"""kill -USR1 on a colocate process prints every thread's stack and each pending asyncio
task's await chain, and the process goes on (colocate.monitor.stack_dump)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from colocate.monitor import stack_dump

SCRIPT = textwrap.dedent("""
    import asyncio, os, signal, threading
    import uvloop
    from colocate.monitor import stack_dump
    assert stack_dump.install()

    async def waits_for_the_engine(ev):
        await ev.wait()

    async def one_sample(ev):
        await waits_for_the_engine(ev)

    async def main():
        ev = asyncio.Event()
        task = asyncio.ensure_future(one_sample(ev))
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()  # while the loop idles
        await asyncio.sleep(1.0)
        ev.set()
        await task

    uvloop.new_event_loop().run_until_complete(main())
    print("went on")
""")


def test_sigusr1_prints_threads_and_the_await_chain_of_each_pending_task_and_the_run_goes_on():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "went on"
    err = done.stderr
    assert "[colocate] stacks (SIGUSR1):" in err and "-- end of stacks" in err
    assert "-- thread MainThread (main)" in err and "-- asyncio: 2 pending task(s)" in err
    chain = err[err.index("in one_sample"):].splitlines()
    assert "in waits_for_the_engine" in chain[1] and "in wait" in chain[2] and chain[3].strip().startswith("awaits ")


def test_the_await_chain_of_a_coroutine_outermost_first():
    async def inner():
        return 1

    async def outer():
        return await inner()

    coro = outer()
    assert [line.rsplit(" in ", 1)[1] for line in stack_dump.awaiting(coro)] == ["outer"]  # not started: one frame
    coro.close()
    assert stack_dump.awaiting(None) == []


def test_install_off_the_main_thread_is_refused_quietly():
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(stack_dump.install()))
    t.start()
    t.join()
    assert got == [False]


def test_installed_twice_in_one_process_dumps_once_per_signal():
    import signal
    before = signal.getsignal(signal.SIGUSR1)
    try:
        assert stack_dump.install() and stack_dump.install()
        handler = signal.getsignal(signal.SIGUSR1)
        assert handler.prints_stacks
        assert stack_dump.install() and signal.getsignal(signal.SIGUSR1) is handler  # not wrapped again
    finally:
        signal.signal(signal.SIGUSR1, before)
