"""A module that starts a thread when imported (tests/test_forkserver.py preloads it)."""

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, daemon=True, name="started-at-import").start()
