#!/usr/bin/env python3
"""A model of a batch beside users at a server of P places, to try batch policies in
seconds before spending bench windows on them (`benches/family.rs` takes minutes a cell).

The server runs up to P requests at once, each for S seconds (users' and batch lines
alike), and queues the rest first come, first served. Users arrive as a Poisson process
at LOAD of the server's capacity. The batch sends a line whenever it has fewer in flight
than its cap, which a policy sets at each reading of the server (every READ seconds):
what it runs, what waits, and how many of those are the batch's own. Printed: users' p99
(waiting and served) against S, and the batch's share of the capacity users leave.

What it leaves out: steps that slow with the batch, a KV cache, answers' travel time,
and the throughput rule and the gate, which bind on other servers. It is a model: where
it and the family bench disagree, the bench is right.

Usage: bench/headroom_model.py [P] [LOAD] [READ]   (defaults: 16 0.4 0.05, the family's
16-seq GPU-like server beside steady users at 40%, read at `load_signal.every`'s default)
"""

import collections
import heapq
import random
import sys

S = 0.18  # 32 tokens at ~5.6-ms steps
SECONDS = 600.0
WARM = 30.0


def run(policy, places, load, read, seed):
    """One run: (users' p99 / S, the batch's share of the idle capacity)."""
    rnd = random.Random(seed)
    rate = load * places / S
    events = []
    running, ours, cap, batch_done = 0, 0, 0, 0
    queue = collections.deque()
    latencies = []
    state = policy.start(places)

    def admit(now):
        nonlocal running
        while running < places and queue:
            who, arrived = queue.popleft()
            running += 1
            heapq.heappush(events, (now + S, "done", (who, arrived)))

    def send(now):
        nonlocal ours
        while ours < cap:
            ours += 1
            queue.append(("batch", now))
            admit(now)

    heapq.heappush(events, (rnd.expovariate(rate), "user", None))
    heapq.heappush(events, (0.0, "read", None))
    while events:
        now, kind, data = heapq.heappop(events)
        if now > SECONDS:
            break
        if kind == "user":
            queue.append(("user", now))
            admit(now)
            heapq.heappush(events, (now + rnd.expovariate(rate), "user", None))
        elif kind == "done":
            who, arrived = data
            running -= 1
            if who == "user" and now > WARM:
                latencies.append(now - arrived)
            if who == "batch":
                ours -= 1
                batch_done += now > WARM
            admit(now)
            send(now)
        else:
            waiting = len(queue)
            others = max(0, running + waiting - ours)
            cap = max(0, int(policy.cap(now, others, ours, waiting)))
            send(now)
            heapq.heappush(events, (now + read, "read", None))
    latencies.sort()
    idle = (1 - load) * places / S
    return latencies[int(0.99 * len(latencies))] / S, batch_done / (SECONDS - WARM) / idle


class Fixed:
    def __init__(self, lines):
        self.lines = lines

    def __str__(self):
        return f"fixed {self.lines}"

    def start(self, places):
        return None

    def cap(self, now, others, ours, waiting):
        return self.lines


class Headroom:
    """`src/concurrency/headroom.rs` beside others, places known: the places less what
    others held over the last 250 ms (and the reading before), less the reserve (the most
    they grew by between two readings over 5 s, one at least), less `tolerated`."""

    def __init__(self, tolerated=0.0):
        self.tolerated = tolerated

    def __str__(self):
        return "headroom" + (f", {self.tolerated:g} tolerated" if self.tolerated else "")

    def start(self, places):
        self.places, self.others, self.rises = places, collections.deque(), collections.deque()

    def cap(self, now, others, ours, waiting):
        while len(self.others) > 1 and now - self.others[1][0] > 0.25:
            self.others.popleft()
        before = [o for _, o in list(self.others)[-2:]]
        if before and others > max(before):
            self.rises.append((now, others - max(before)))
        level = max([o for _, o in self.others] + [others])
        self.others.append((now, others))
        while self.rises and now - self.rises[0][0] > 5.0:
            self.rises.popleft()
        reserve = max([r for _, r in self.rises] + [1.0])
        return self.places - level - max(1.0, reserve - self.tolerated)


class Follow:
    """The places less what others hold at this reading, less `margin`."""

    def __init__(self, margin):
        self.margin = margin

    def __str__(self):
        return f"follow, margin {self.margin}"

    def start(self, places):
        self.places = places

    def cap(self, now, others, ours, waiting):
        return self.places - self.margin - others


class Learned(Follow):
    """A follower whose margin is learned from the queues seen: a place more after a
    reading where at least 1, or `tolerated` of the places, waited; `ebb` of a place less
    after any other (1 at the least, the places at the most)."""

    def __init__(self, tolerated=0.05, ebb=0.01):
        super().__init__(1.0)
        self.tolerated, self.ebb = tolerated, ebb

    def __str__(self):
        return f"learned, {self.tolerated:g} tolerated"

    def start(self, places):
        super().start(places)
        self.margin = 1.0

    def cap(self, now, others, ours, waiting):
        if waiting >= max(1.0, self.tolerated * self.places):
            self.margin = min(self.places, self.margin + 1.0)
        else:
            self.margin = max(1.0, self.margin - self.ebb)
        return super().cap(now, others, ours, waiting)


def main():
    places = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    load = float(sys.argv[2]) if len(sys.argv) > 2 else 0.4
    read = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
    free = int(places * (1 - load))
    fixed = sorted({max(1, round(free * f)) for f in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)})
    policies = [Fixed(n) for n in fixed]
    policies += [Headroom(), Headroom(0.1 * places)]
    policies += [Follow(m) for m in sorted({max(1, round(places * f)) for f in (0.25, 0.4, 0.5)})]
    policies += [Learned()]
    print(f"{places} places, users at {load:.0%}, a reading every {read * 1000:.0f} ms; three seeds each")
    print("| policy | users' p99 / S | batch's share of the idle capacity |")
    print("| --- | --- | --- |")
    for policy in policies:
        runs = [run(policy, places, load, read, seed) for seed in (1, 2, 3)]
        p99 = " / ".join(f"{p:.2f}" for p, _ in runs)
        share = " / ".join(f"{s:.2f}" for _, s in runs)
        print(f"| {policy} | {p99} | {share} |", flush=True)


if __name__ == "__main__":
    main()
