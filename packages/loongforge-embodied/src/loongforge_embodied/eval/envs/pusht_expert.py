"""A scripted PushT expert that plans pushes in a copy of the simulator (privileged state: agent + block pose).

Each call plans one *push*: walk around the block to a point next to one of its edges, then push straight into
that edge by some distance. Every candidate (edge point x push distance) is rolled out in gym-pusht's own physics
(the same PD-controlled pusher and pymunk contacts), and the one that brings the block's pose closest to the goal
is returned as an action chunk that ends with the pusher at rest, so the next plan starts from a state given by
positions alone. The contacts are frictionless and the block stops when released, so what the copy predicts is
what the environment does.
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np

GOAL = np.array([256.0, 256.0, math.pi / 4])  # gym-pusht's goal pose of the block's origin (x, y, angle)
COG = np.array([0.0, 45.0])  # the T's centre of gravity in its body frame
# The T's outline in its body frame (counter-clockwise), its edges' outward normals follow from the order.
OUTLINE = np.array([(-60, 0), (60, 0), (60, 30), (15, 30), (15, 120), (-15, 120), (-15, 30), (-60, 30)], float)
AGENT_RADIUS = 15.0
ANGLE_WEIGHT = 60.0  # px of position error one radian of angle error is worth
PUSH_DISTANCES = (3.0, 8.0, 20.0, 45.0)
FAR = 60.0  # pose cost above which only the long pushes are tried
SAFE_RADIUS = 100.0  # the agent circles the block this far from its centre of gravity
ROLLOUTS = 6  # edge points rolled out per plan: those whose push moves the block most towards the goal
INERTIA = 2550.0  # the T's moment of inertia about its centre of gravity (mass 1), for ranking pushes


def _rot(theta: float) -> np.ndarray:
    c, s = math.cos(theta), math.sin(theta)
    return np.array([[c, -s], [s, c]])


def pose_cost(block_xy, block_angle: float) -> float:
    """Distance of the block's pose to the goal: centre-of-gravity px + ANGLE_WEIGHT x wrapped angle error."""
    com = np.asarray(block_xy) + _rot(block_angle) @ COG
    goal_com = GOAL[:2] + _rot(GOAL[2]) @ COG
    d = (block_angle - GOAL[2] + math.pi) % (2 * math.pi) - math.pi
    return float(np.linalg.norm(com - goal_com) + ANGLE_WEIGHT * abs(d))


def _contacts(spacing: float = 15.0):
    """(point, outward normal) pairs along the outline, away from the concave corners."""
    out = []
    n = len(OUTLINE)
    for i in range(n):
        a, b = OUTLINE[i], OUTLINE[(i + 1) % n]
        edge = b - a
        length = float(np.linalg.norm(edge))
        normal = np.array([edge[1], -edge[0]]) / length
        # NOTE: the outline runs counter-clockwise in pymunk's y-up frame; flip if the normal points inwards.
        if np.dot(normal, (a + b) / 2 - COG) < 0:
            normal = -normal
        k = max(1, int(length // spacing))
        for j in range(k):
            p = a + edge * (j + 0.5) / k
            out.append((p, normal))
    return out


CONTACTS = _contacts()


class PushTSim:
    """gym-pusht's physics, set from a pose (everything at rest) and stepped like ``PushTEnv.step``."""

    def __init__(self):
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
        from gym_pusht.envs.pusht import PushTEnv

        self.env = PushTEnv(obs_type="state")
        self.env._setup()
        self.agent, self.block = self.env.agent, self.env.block
        self.n_sub = int(1 / (self.env.dt * self.env.control_hz))

    def set(self, agent_xy, block_xy, block_angle: float, agent_v=(0.0, 0.0)) -> None:
        self.agent.position = tuple(map(float, agent_xy))
        self.agent.velocity = tuple(map(float, agent_v))
        self.block.angle = float(block_angle)
        self.block.position = tuple(map(float, block_xy))
        self.block.velocity = (0.0, 0.0)
        self.block.angular_velocity = 0.0

    def snapshot(self):
        a, b = self.agent, self.block
        return (tuple(a.position), tuple(a.velocity), tuple(b.position), b.angle, tuple(b.velocity),
                b.angular_velocity)

    def restore(self, s) -> None:
        a, b = self.agent, self.block
        a.position, a.velocity = s[0], s[1]
        b.angle, b.position, b.velocity, b.angular_velocity = s[3], s[2], s[4], s[5]

    def step(self, action) -> None:
        env, agent = self.env, self.agent
        ax, ay = float(action[0]), float(action[1])
        for _ in range(self.n_sub):
            px, py = agent.position
            vx, vy = agent.velocity
            agent.velocity = (vx + (env.k_p * (ax - px) - env.k_v * vx) * env.dt,
                              vy + (env.k_p * (ay - py) - env.k_v * vy) * env.dt)
            env.space.step(env.dt)

    def cost(self) -> float:
        return pose_cost(self.block.position, self.block.angle)


def _line(start, end, max_step: float) -> list[np.ndarray]:
    start, end = np.asarray(start, float), np.asarray(end, float)
    n = max(1, math.ceil(float(np.linalg.norm(end - start)) / max_step))
    return [start + (end - start) * (i + 1) / n for i in range(n)]


def _approach(agent, com, pre) -> list[np.ndarray]:
    """Targets from ``agent`` to ``pre`` that circle the block's centre of gravity ``com`` at SAFE_RADIUS."""
    agent, com, pre = (np.asarray(v, float) for v in (agent, com, pre))
    path: list[np.ndarray] = []
    r_agent = float(np.linalg.norm(agent - com))
    a0 = math.atan2(*(agent - com)[::-1])
    a1 = math.atan2(*(pre - com)[::-1])
    turn = (a1 - a0 + math.pi) % (2 * math.pi) - math.pi
    if abs(turn) > math.radians(25) or r_agent < 0.5 * SAFE_RADIUS:
        here = agent
        if r_agent < SAFE_RADIUS:
            out = com + SAFE_RADIUS * np.array([math.cos(a0), math.sin(a0)])
            path += _line(here, out, 30.0)
            here = out
        steps = max(1, math.ceil(abs(turn) / math.radians(30)))
        for i in range(steps):
            a = a0 + turn * (i + 1) / steps
            wp = np.clip(com + SAFE_RADIUS * np.array([math.cos(a), math.sin(a)]), 20.0, 492.0)
            path += _line(here, wp, 30.0)
            here = wp
        path += _line(here, pre, 30.0)
    else:
        path += _line(agent, pre, 30.0)
    return path + [pre, pre]  # NOTE: two holds: the pusher settles before it pushes


def _ranked_contacts(block_xy, block_angle: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """World-frame (point, normal) of every edge point, best first: a frictionless push along -normal moves the
    block by the twist (force, torque / inertia); rank by its cosine with the twist towards the goal."""
    rot = _rot(block_angle)
    com = block_xy + rot @ COG
    goal_com = GOAL[:2] + _rot(GOAL[2]) @ COG
    d_angle = (GOAL[2] - block_angle + math.pi) % (2 * math.pi) - math.pi
    want = np.array([*(goal_com - com), ANGLE_WEIGHT * d_angle])
    want /= np.linalg.norm(want) + 1e-9
    scored = []
    for p_local, n_local in CONTACTS:
        p, n = block_xy + rot @ p_local, rot @ n_local
        r = p - com
        torque = r[0] * -n[1] - r[1] * -n[0]
        twist = np.array([-n[0], -n[1], ANGLE_WEIGHT * torque / INERTIA])
        scored.append((-float(np.dot(twist, want) / np.linalg.norm(twist)), p, n))
    scored.sort(key=lambda t: t[0])
    return [(p, n) for _, p, n in scored]


def plan_push(sim: PushTSim, agent_xy, block_xy, block_angle: float) -> np.ndarray:
    """The best push from this state as an action chunk (T, 2), planned by rolling candidates out in ``sim``."""
    block_xy = np.asarray(block_xy, float)
    rot = _rot(block_angle)
    com = block_xy + rot @ COG
    sim.set(agent_xy, block_xy, block_angle)
    start = sim.snapshot()
    distances = PUSH_DISTANCES[2:] if sim.cost() > FAR else PUSH_DISTANCES
    best_cost, best = math.inf, None
    for p, n in _ranked_contacts(block_xy, block_angle)[:ROLLOUTS]:
        pre = p + n * (AGENT_RADIUS + 3.0)
        if not (20.0 <= pre[0] <= 492.0 and 20.0 <= pre[1] <= 492.0):
            continue
        approach = _approach(agent_xy, com, pre)
        sim.restore(start)
        for a in approach:
            sim.step(a)
        after_approach = sim.snapshot()
        for d in distances:
            sim.restore(after_approach)
            end = pre - n * (3.0 + d)
            push = _line(pre, end, 10.0) + [end, end]
            for a in push:
                sim.step(a)
            cost = sim.cost() + 0.01 * (len(approach) + len(push))
            if cost < best_cost:
                best_cost, best = cost, approach + push
    return np.clip(np.array(best, dtype=np.float32), 0.0, 512.0)


class PushTExpertPolicy:
    """The planner served as a policy: reads ``observation.environment_state``, answers one push per request
    (executed whole: ``n_action_steps`` 0)."""

    name = "expert"
    prompt = "ignored"

    def __init__(self):
        from loongforge_embodied.eval.protocol import vector

        self.spec = {"observation.environment_state": vector(5)}
        self._sim: PushTSim | None = None

    def metadata(self) -> dict:
        return {"policy": self.name, "features": {k: f.to_dict() for k, f in self.spec.items()}, "action_dim": 2,
                "chunk_size": 0, "n_action_steps": 0}

    def infer_batch(self, requests: list[dict]) -> list[dict]:
        if self._sim is None:
            self._sim = PushTSim()
        out = []
        for req in requests:
            s = req["observation.environment_state"].astype(np.float64)
            out.append({"actions": plan_push(self._sim, s[:2], s[2:4], float(s[4]))})
        return out
