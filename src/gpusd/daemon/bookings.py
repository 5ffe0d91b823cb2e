"""Bookings of this host's GPUs ahead of time: ``gpusd reserve --at WHEN --for DUR`` (docs/pool.md, "Time").

``install(app, daemon, pool)`` adds

* ``POST /api/v1/bookings`` — book ``count`` GPUs from ``start`` (a wall-clock time) for ``duration``
  seconds; signed with the fleet secret *and* the booker's SSH key (a booking belongs to an account,
  :mod:`gpusd.daemon.users`); bounded by the policy's ``bookings`` (how far ahead, how long, how many
  per user); a booking that overlaps others on every GPU it could have is refused naming them (409);
* ``GET /api/v1/bookings`` — this host's bookings (the booker and the note are private fields);
* ``DELETE /api/v1/bookings/{id}`` — cancel (its booker, or root of this host); a booking already
  started ends, and its hold with it.

Each booking is one file in ``STATE_DIR/bookings/`` (the remote leases' rules, :mod:`poolstate`: 0600
in a 0700 directory of the daemon's own); a damaged file costs that booking, logged and removed.  The
daemon writes the bookings of this host to ``STATE_DIR/bookings.json`` too, which every lease request
reads (:mod:`gpusd.alloc.bookings`: the backfill rule).

From ``start`` on the daemon holds the booked GPUs for the booker (:meth:`Bookings.tick`): a remote
lease of the pool in the booker's name (:class:`gpusd.daemon.pool.Held`), ending at the booking's
end, written down and taken back after a restart like any remote lease.  Bookings are wall-clock times;
the daemon keeps their deadlines on the monotonic clock and derives them again when it sees the wall
clock step (docs/pool.md, "Clocks").  The hold is a lease like any other: where a GPU is still held at
``start`` (a job that outran the wall clock's step, one that ignored the rule), the hold waits for it,
late, and never shares it.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..alloc.bookings import MAX_BOOKINGS, MAX_DEVICES, MAX_NOTE, Booking, set_own_dir, write_summary
from ..alloc.policy import load
from ..errors import ConfigError, GpusdError, http_answer
from ..ids import LeaseId
from ..model import BookingInfo
from ..sanitize import dumps, for_terminal, json_object
from ..units import format_clock
from . import poolstate
from .access import can_see_private
from .pool import Held, signer_of
from .routes import RouteDef, add_routes

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

    from .pool import Held, Pool
    from .routes import RouteDef
    from .users import Account

log = logging.getLogger("gpusd.bookings")

DIR_NAME = "bookings"
FORMAT = 1
# seconds between looks at the bookings (start a hold, end a booking, a wall-clock step)
TICK = 0.5
# seconds: a change of (wall - monotonic) beyond this is a step of the wall clock
STEP = 1.0
# without a policy's bounds
DEFAULTS = {"horizon_days": 30.0, "max_hours": 7 * 24.0, "max_per_user": 8.0}


def bounds() -> dict[str, float]:
    """The policy's ``bookings`` bounds (alloc/policy.py), the defaults where it has none."""
    return {**DEFAULTS, **load().bookings}


class Bookings:
    """This host's bookings: kept in :attr:`book`, on disk in the state directory, held from their start."""

    def __init__(self, daemon: Any, pool: Pool | None) -> None:
        self.daemon = daemon
        self.pool = pool
        state_dir = getattr(daemon, "state_dir", None)
        self.state_dir: Path | None = Path(state_dir) if state_dir is not None else None
        self.book: dict[str, Booking] = {}
        # wall - monotonic: a change is a wall-clock step
        self.offset = time.time() - time.monotonic()
        # bookings whose hold is being taken (on the pool's executor)
        self.holding: set[str] = set()
        # bookings whose hold could not be taken at once (said once)
        self.late: set[str] = set()
        # wall-clock steps seen (tests count them)
        self.steps = 0
        self.holds = 0
        self.task: asyncio.Task[None] | None = None

    # -- the store ------------------------------------------------------------------------------------
    def load(self) -> None:
        """The bookings a previous run wrote down; a damaged one is logged and removed."""
        if self.state_dir is None:
            return

        def check(name: str, d: dict[str, Any] | None) -> Booking:
            if d is None or d.get("format") != FORMAT:
                raise ValueError("unreadable")
            b = Booking.from_dict(d)
            if f"{b.booking_id}.json" != name:
                raise ValueError("its name is not its id")
            return b

        for b in poolstate.load_records(self.state_dir, DIR_NAME, MAX_BOOKINGS, check, "the bookings",
                                        "booking record %s"):
            self.book[b.booking_id] = b
        if self.book:
            log.info("took back %d booking(s)", len(self.book))

    def _save(self, b: Booking) -> bool:
        if self.state_dir is None:
            return True
        return poolstate.write(self.state_dir, b.booking_id, b.to_dict(), DIR_NAME)

    def _forget(self, booking_id: str) -> None:
        self.book.pop(booking_id, None)
        if self.state_dir is not None:
            poolstate.remove(self.state_dir, booking_id, DIR_NAME)

    def publish(self) -> None:
        """The summary every lease request reads (alloc/bookings.py)."""
        if self.state_dir is None:
            return
        try:
            write_summary(self.state_dir, sorted(self.book.values(), key=lambda b: b.start))
        except OSError as exc:
            log.warning("cannot write the bookings summary: %s", exc)

    # -- requests -------------------------------------------------------------------------------------
    def create(self, body: dict[str, Any], account: Account | None, gpus: list[tuple[str, int]],
               now: float | None = None) -> tuple[int, dict[str, Any]]:
        """Book for ``account`` as ``body`` asks, among ``gpus`` (UUID, index) of this host."""
        if account is None:
            return 401, {"error": "a booking belongs to an account: sign it with your SSH key (ssh-agent or "
                                  "--identity FILE, docs/security.md)", "reason": "user_key"}
        now = time.time() if now is None else now
        try:
            count, start, duration, note, include = _terms(body)
        except ConfigError as exc:
            return http_answer(exc)
        b = bounds()
        if start <= now:
            return http_answer(ConfigError("WHEN is in the past: a booking starts later than now"))
        if start - now > b["horizon_days"] * 86400:
            return http_answer(ConfigError(f"WHEN is beyond the policy's horizon: bookings start at most "
                                           f"{b['horizon_days']:g} day(s) ahead (bookings.horizon_days)"))
        if duration > b["max_hours"] * 3600:
            return http_answer(ConfigError(f"a booking lasts at most {b['max_hours']:g} hour(s) by the policy "
                                           "(bookings.max_hours)"))
        mine = [x for x in self.book.values() if x.user == account.name and x.end > now]
        if len(mine) >= b["max_per_user"]:
            return 429, {"error": f"{account.name} holds {len(mine)} booking(s) here: the policy allows "
                                  f"{b['max_per_user']:g} (bookings.max_per_user)", "reason": "policy"}
        if len(self.book) >= MAX_BOOKINGS:
            return 429, {"error": f"this host keeps {MAX_BOOKINGS} bookings at most", "reason": "policy"}
        end = start + duration
        allowed = [(u, i) for u, i in gpus if include is None or u in include or str(i) in include]
        free: list[tuple[str, int, list[Booking]]] = []
        clashes: list[tuple[str, int, list[Booking]]] = []
        for uuid, index in allowed:
            clash = [x for x in self.book.values() if uuid in x.devices and x.start < end and start < x.end]
            (clashes if clash else free).append((uuid, index, clash))
        if len(free) < count:
            named = {x.booking_id: x for _, _, clash in clashes for x in clash}
            said = "; ".join(f"booking {x.booking_id} of {x.user} ({format_clock(x.start)} to {format_clock(x.end)}, "
                             f"GPU {','.join(map(str, x.indices))})" for x in list(named.values())[:4])
            return 409, {"error": f"{count} GPU(s) are not free from {format_clock(start)} to {format_clock(end)} "
                                  f"here ({len(free)} of {len(allowed)} are)" + (f": it conflicts with {said}"
                                                                                   if said else ""),
                         "reason": "conflict", "conflicts": sorted(named)}
        chosen = free[:count]
        booking = Booking(LeaseId.new(), account.name, tuple(u for u, _, _ in chosen), start, end,
                          tuple(i for _, i, _ in chosen), note, now)
        if not self._save(booking):
            return 507, {"error": "the booking could not be written down (the state directory)", "reason": "disk_full"}
        self.book[booking.booking_id] = booking
        self.publish()
        log.info("booking %s: GPU %s for %s from %.0f to %.0f", booking.booking_id,
                 ",".join(map(str, booking.indices)), booking.user, start, end)
        self.daemon.publish("booking_made", {"bookings": [self.to_dict(booking)]})
        return 201, self.to_dict(booking)

    def cancel(self, booking_id: str, account: Account | None) -> tuple[int, dict[str, Any]]:
        b = self.book.get(booking_id)
        if b is None:
            return 404, {"error": f"no booking {booking_id[:32]!r} here"}
        if account is None or (account.name != b.user and not account.is_root):
            return 403, {"error": "only its booker (or root of this host) may cancel a booking", "reason": "owner"}
        self._forget(booking_id)
        self.publish()
        self._end_hold(b, "its booking was cancelled")
        self.daemon.publish("booking_cancelled", {"bookings": [self.to_dict(b)]})
        return 200, {"cancelled": booking_id}

    def to_dict(self, b: Booking) -> dict[str, Any]:
        return {**b.to_dict(), "host": self.daemon.hostname, "node_id": self.daemon.node_id,
                "held": b.lease is not None and self.pool is not None and b.lease in self.pool.held}

    def infos(self) -> list[BookingInfo]:
        """The bookings not yet over, soonest first, as the host's snapshot carries them."""
        now = time.time()
        return [BookingInfo(b.booking_id, b.start, b.end, list(b.indices), b.user, self._held(b))
                for b in sorted(list(self.book.values()), key=lambda b: b.start) if b.end > now][:64]

    def listing(self) -> list[dict[str, Any]]:
        return [self.to_dict(b) for b in sorted(self.book.values(), key=lambda b: b.start)]

    # -- time -----------------------------------------------------------------------------------------
    def deadline(self, wall: float) -> float:
        """A booking's wall-clock time as a deadline on the monotonic clock (derived again after a step)."""
        return wall - self.offset

    def _clock(self) -> None:
        offset = time.time() - time.monotonic()
        if abs(offset - self.offset) > STEP:
            self.steps += 1
            step, self.offset = offset - self.offset, offset
            log.warning("the wall clock stepped by %+.1fs: the bookings' deadlines are derived again", step)
            self.daemon.publish("clock_step", {"step": step})

    async def tick(self) -> None:
        """Start the holds due, end the bookings over."""
        self._clock()
        now = time.monotonic()
        changed = False
        for b in list(self.book.values()):
            if now >= self.deadline(b.end):
                self._forget(b.booking_id)
                self.late.discard(b.booking_id)
                changed = True
                log.info("booking %s of %s is over", b.booking_id, b.user)
                continue
            if now >= self.deadline(b.start) and b.booking_id not in self.holding and not self._held(b):
                self.holding.add(b.booking_id)
                asyncio.ensure_future(self._hold(b))
        if changed:
            self.publish()

    def _held(self, b: Booking) -> bool:
        return b.lease is not None and self.pool is not None and b.lease in self.pool.held

    async def _hold(self, b: Booking) -> None:
        """Hold ``b``'s GPUs for its booker until its end: a remote lease of the pool in its name."""
        pool = self.pool
        try:
            if pool is None or b.booking_id not in self.book:
                return
            # a hold taken back after a restart is the same hold
            await pool._adopted()
            cur = self.book.get(b.booking_id)
            if cur is None or self._held(cur):
                return
            now = time.monotonic()
            end = self.deadline(b.end)
            held = Held("", None, b.user, f"booking {b.booking_id}", None, max(1.0, end - now), time.time(), now,
                        pool._expiry(now, now, end - now), [], None, f"user {b.user}", None, b.end)
            kwargs = {"count": len(b.devices), "include": list(b.devices)}
            try:
                await asyncio.get_running_loop().run_in_executor(pool.executor, pool._grant_held, held, kwargs, True)
            except GpusdError as exc:
                if b.booking_id not in self.late:
                    self.late.add(b.booking_id)
                    log.warning("booking %s of %s: its GPUs cannot be held yet (%s); held as soon as they are free",
                                b.booking_id, b.user, exc)
                    self.daemon.publish("booking_late", {"bookings": [self.to_dict(b)], "reason": str(exc)[:300]})
                return
            if b.booking_id not in self.book:  # cancelled meanwhile
                pool.held[held.lease_id] = held
                pool.end(held.lease_id, "released: its booking was cancelled")
                return
            pool.held[held.lease_id] = held
            self.holds += 1
            started = Booking(**{**_fields(b), "lease": held.lease_id})
            self.book[b.booking_id] = started
            self._save(started)
            self.publish()
            log.info("booking %s: GPU %s held for %s until its end (lease %s)", b.booking_id,
                     ",".join(map(str, b.indices)), b.user, held.lease_id)
            self.daemon.publish("booking_started", {"bookings": [self.to_dict(started)]})
        finally:
            self.holding.discard(b.booking_id)

    def _end_hold(self, b: Booking, why: str) -> Held | None:
        if b.lease is None or self.pool is None:
            return None
        return self.pool.end(b.lease, f"released: {why}")

    def hand_over(self, user: str | None) -> list[Held]:
        """``user`` asks for GPUs here while a booking of theirs is held: the hold lets go (their own
        request takes the GPUs; everyone else's is still kept off them by the booking)."""
        out = []
        for b in self.book.values():
            if b.user == user and self._held(b):
                held = self._end_hold(b, "handed to its booker's request")
                if held is not None:
                    out.append(held)
        return out

    async def released(self, held: Held) -> None:
        """Until the hold ``held`` (ended by :meth:`hand_over`) has freed its GPUs (bounded)."""
        if self.pool is not None:
            await self.pool.ended(held)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - a bad booking must not stop the others
                log.warning("bookings: %r", exc)


def _fields(b: Booking) -> dict[str, Any]:
    return {"booking_id": b.booking_id, "user": b.user, "devices": b.devices, "start": b.start, "end": b.end,
            "indices": b.indices, "note": b.note, "created": b.created, "lease": b.lease}


def _terms(body: dict[str, Any]) -> tuple[int, float, float, str | None, set[str] | None]:
    """count, start, duration, note, include of a booking request; ConfigError when bad."""
    count, start, duration = body.get("count", 1), body.get("start"), body.get("duration")
    if type(count) is not int or not 0 < count <= MAX_DEVICES:
        raise ConfigError(f"bad 'count' in the booking: a whole number of GPUs from 1 to {MAX_DEVICES}")
    if not isinstance(start, (int, float)) or isinstance(start, bool) or not math.isfinite(start) or start < 0:
        raise ConfigError("bad 'start' in the booking: a wall-clock time (seconds since the epoch)")
    if (not isinstance(duration, (int, float)) or isinstance(duration, bool) or not math.isfinite(duration)
            or not duration > 0):
        raise ConfigError("a booking's duration (--for) must be longer than 0")
    note = body.get("note")
    if note is not None and not isinstance(note, str):
        raise ConfigError("bad 'note' in the booking")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or len(include) > MAX_DEVICES
                                or not all(isinstance(x, str) and len(x) <= 128 for x in include)):
        raise ConfigError("bad 'include' in the booking: a list of GPU indices or UUIDs")

    return (count, float(start), float(duration), for_terminal(note, MAX_NOTE) if note else None,
            set(include) if include is not None else None)


def install(app: web.Application, daemon: Any, pool: Pool | None) -> Bookings:
    bookings = Bookings(daemon, pool)

    async def lifecycle(app: web.Application) -> Any:
        set_own_dir(bookings.state_dir)
        bookings.load()
        bookings.publish()
        bookings.task = asyncio.ensure_future(bookings.loop())
        yield
        bookings.task.cancel()
        set_own_dir(None)

    app.cleanup_ctx.append(lifecycle)
    add_routes(app, routes(bookings))
    return bookings


def routes(bookings: Bookings) -> list[RouteDef]:
    from aiohttp import web

    daemon = bookings.daemon

    def answer(status: int, data: object) -> web.Response:
        return web.Response(text=dumps(data, separators=(",", ":")), status=status,
                            content_type="application/json", headers={"Cache-Control": "no-store"})

    async def who(request: web.Request) -> tuple[Account | None, web.Response | None]:
        return await signer_of(request, bookings.pool, daemon)

    async def body_of(request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if len(raw) > 16384:
            raise ConfigError("a booking request is at most 16384 bytes")
        try:
            return json_object(raw or b"{}")
        except ValueError:
            raise ConfigError("a booking request is a JSON object") from None

    def gpus() -> list[tuple[str, int]]:
        inventory = getattr(daemon, "inventory", None)
        snap = inventory.snapshot(detail=False) if inventory is not None else None
        return [(g.uuid, g.index) for g in snap.gpus] if snap is not None else []

    async def create(request: web.Request) -> web.Response:
        account, refused = await who(request)
        if refused is not None:
            return refused
        try:
            body = await body_of(request)
        except ConfigError as exc:
            return answer(*http_answer(exc))
        found = await asyncio.get_running_loop().run_in_executor(None, gpus)
        return answer(*bookings.create(body, account, found))

    async def listing(request: web.Request) -> web.Response:
        out = bookings.listing()
        if not can_see_private(request):
            for d in out:
                d["user"] = d["note"] = None
        return answer(200, {"host": daemon.hostname, "node_id": daemon.node_id, "bookings": out})

    async def delete(request: web.Request) -> web.Response:
        account, refused = await who(request)
        if refused is not None:
            return refused
        return answer(*bookings.cancel(request.match_info["id"][:64], account))

    return [RouteDef("POST", "/api/v1/bookings", create),
            RouteDef("GET", "/api/v1/bookings", listing),
            RouteDef("DELETE", "/api/v1/bookings/{id}", delete)]
