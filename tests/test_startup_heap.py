"""freeze_startup_heap: start-up objects leave the collector's generations; later garbage cycles
are still collected. Run in a child process so the test process's own heap stays as it is."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import gc, weakref
    from backend.types.startup_heap import freeze_startup_heap

    class Node:
        pass

    startup = [Node() for _ in range(1000)]
    frozen = freeze_startup_heap()
    assert frozen >= 1000, frozen
    assert not any(gc.is_tracked(n) and n in gc.get_objects() for n in startup[:3])

    late = Node()
    late.self = late  # a cycle made after start-up
    alive = weakref.ref(late)
    del late
    gc.collect()
    assert alive() is None, "a cycle made after the freeze was not collected"
    print("ok", frozen)
""")


def test_startup_objects_frozen_and_later_cycles_collected():
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
