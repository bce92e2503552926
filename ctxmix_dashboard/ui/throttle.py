"""Failed logins slow down: a growing delay per client address, capped, and logged.

The delay doubles with each failure of one address (1 s, 2 s, 4 s, ...) up to a ceiling, so a
password cannot be guessed at 40 tries a second, while the ceiling keeps one attacker (or a
proxy that hides many users behind one address) from locking every collaborator out for long.
Pure Python and server-wide (module state is shared by every session of one server process).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

log = logging.getLogger("ctxmix.login")


class LoginThrottle:
    def __init__(self, base: float = 1.0, ceiling: float = 30.0, max_clients: int = 10_000, clock=time.monotonic):
        self.base, self.ceiling, self.max_clients, self.clock = base, ceiling, max_clients, clock
        self._state: OrderedDict[str, tuple[int, float]] = OrderedDict()  # client -> (failures, blocked until)
        self._lock = threading.Lock()

    def wait(self, client: str) -> float:
        """Seconds before `client` may try again (0 when it may now)."""
        with self._lock:
            _, until = self._state.get(client, (0, 0.0))
        return max(0.0, until - self.clock())

    def failed(self, client: str) -> float:
        """Record a failed attempt; returns the delay now imposed on the client."""
        with self._lock:
            n = self._state.pop(client, (0, 0.0))[0] + 1
            delay = min(self.ceiling, self.base * 2 ** (n - 1))
            self._state[client] = (n, self.clock() + delay)
            while len(self._state) > self.max_clients:
                self._state.popitem(last=False)
        log.warning("failed login from %s (%d in a row); next attempt allowed in %.0f s", client, n, delay)
        return delay

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._state.pop(client, None)


THROTTLE = LoginThrottle()
