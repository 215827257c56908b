"""Maze: a small deterministic grid game as text, for GiGPO's anchor states (arXiv 2505.10978).

The observation is the grid, one line per row: ``A`` the agent, ``G`` the goal, ``#`` walls, ``.`` floor::

    A..
    .#.
    ..G

Each policy turn is one action: ``u``, ``d``, ``l`` or ``r`` (``actions`` renames them; the turn's text
must be exactly one of them). A move into a wall or off the grid leaves the agent where it is; any
other text is an invalid action: ``-invalid_penalty`` (0.1, the paper's) and the state is unchanged.
Reaching the goal earns ``goal_reward`` (1) and ends the episode; ``rollout.max_turns`` bounds it.
The same grid recurs across the trajectories of a group and within one (after a bump or an invalid
action), which is what GiGPO's step-level groups need. With ``rollout.max_completion_length: 1`` a
policy turn is a single token, so a random char-level policy sometimes acts validly.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from envs.base import Environment, StepResult

MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1)]  # up, down, left, right


MAX_SIZE = 64  # a 64 x 64 maze is ~4,200 characters an observation; 10^6 took every byte of memory before a word


def render(size: int, walls: set[tuple[int, int]], agent: tuple[int, int], goal: tuple[int, int]) -> str:
    rows = []
    for r in range(size):
        line = ""
        for c in range(size):
            line += "A" if (r, c) == agent else "G" if (r, c) == goal else "#" if (r, c) in walls else "."
        rows.append(line)
    return "\n".join(rows)


def distance(size: int, walls: set, a: tuple, b: tuple) -> int:
    """Shortest path length from a to b (-1 when unreachable)."""
    seen, q = {a: 0}, deque([a])
    while q:
        p = q.popleft()
        if p == b:
            return seen[p]
        for dr, dc in MOVES:
            n = (p[0] + dr, p[1] + dc)
            if 0 <= n[0] < size and 0 <= n[1] < size and n not in walls and n not in seen:
                seen[n] = seen[p] + 1
                q.append(n)
    return -1


class MazeEnv(Environment):
    def __init__(self, tools=None, actions: str | list[str] = "udlr", invalid_penalty: float = 0.1,
                 goal_reward: float = 1.0, **_: Any):
        super().__init__(tools)
        names = list(actions)
        if len(names) != 4 or len(set(names)) != 4:
            raise ValueError(f"env.kwargs.actions={actions!r} must name 4 distinct actions (up, down, left, right)")
        self.moves = dict(zip(names, MOVES))
        self.invalid_penalty, self.goal_reward = invalid_penalty, goal_reward

    @classmethod
    def tasks(cls, num_examples: int, seed: int, size: int = 3, walls: int = 0, max_distance: int = 0,
              **_: Any) -> list[dict[str, Any]]:
        """Seeded mazes: ``walls`` wall cells, start and goal apart and connected (at most ``max_distance``
        moves apart when > 0)."""
        if not 2 <= size <= MAX_SIZE:  # every prompt and observation is size x size characters (and the draws size^2)
            raise ValueError(f"env.kwargs.size={size} is invalid: from 2 to {MAX_SIZE} (each observation is the "
                             f"whole size x size grid as text)")
        if not 0 <= walls <= size * size - 2:
            raise ValueError(f"env.kwargs.walls={walls} is invalid: from 0 to size * size - 2 = {size * size - 2}")
        if max_distance < 0:
            raise ValueError(f"env.kwargs.max_distance={max_distance} is invalid: >= 1, or 0 for any distance")
        rng = random.Random(seed)
        cells = [(r, c) for r in range(size) for c in range(size)]
        rows = []
        draws = 0
        while len(rows) < num_examples:
            draws += 1
            if draws > 1000 * (num_examples + 1):  # under 0.1% of the draws accepted: bounded, not a hang
                raise ValueError(f"env.kwargs: {len(rows)} mazes in {draws} draws with size={size}, walls={walls}, "
                                 f"max_distance={max_distance}: start and goal are almost never connected; "
                                 "use fewer walls or a larger max_distance")
            picks = rng.sample(cells, walls + 2)
            w, start, goal = set(picks[:walls]), picks[walls], picks[walls + 1]
            d = distance(size, w, start, goal)
            if d < 1 or (max_distance and d > max_distance):
                continue
            rows.append({"prompt": render(size, w, start, goal), "size": size, "walls": sorted(w),
                         "start": list(start), "goal": list(goal), "distance": d})
        return rows

    def reset(self, row: dict[str, Any]) -> str:
        self.size = int(row["size"])
        self.walls = {tuple(x) for x in row["walls"]}
        self.pos, self.goal = tuple(row["start"]), tuple(row["goal"])
        return render(self.size, self.walls, self.pos, self.goal)

    def step(self, action: str) -> StepResult:
        move = self.moves.get(action.strip())
        if move is None:
            return StepResult(self._obs(), -self.invalid_penalty, False, {"invalid": True})
        n = (self.pos[0] + move[0], self.pos[1] + move[1])
        if 0 <= n[0] < self.size and 0 <= n[1] < self.size and n not in self.walls:
            self.pos = n
        if self.pos == self.goal:
            return StepResult(None, self.goal_reward, True)
        return StepResult(self._obs(), 0.0, False)

    def _obs(self) -> str:
        return render(self.size, self.walls, self.pos, self.goal)
