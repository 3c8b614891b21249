"""Naive references: plain-Python/NumPy implementations of every detector kernel.

One module (stumpy's ``tests/naive.py`` pattern): each ``ref_*`` function computes, slowly and
obviously, what a Numba kernel in ``detectors/`` computes; the per-detector test modules check
that kernel and reference agree (bit for bit where the arithmetic order is the same), and
:data:`REFERENCES` maps registry names to their references so the conformance suite can check
that none is missing (a new detector may instead keep its reference in a ``REFERENCES`` dict of
its own test module, see ``tests/detectors/test_conformance.py:check_reference``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from statistics import NormalDist

import numpy as np

from detectors.ewma import LOG_FLOOR
from detectors.ratio import TINY
from detectors.robust import MAD_SCALE

#: Gaussian sigma per mean absolute deviation (ActivationShift's scale estimate)
SIG = math.sqrt(math.pi / 2)

# ---------------------------------------------------------------------- activation


def ref_shift(feats, miss=None, log_space=(False, True, True, True), alpha=0.02, warmup=30,
              threshold=6.0, min_scale=0.01, clip=4.0, aggregate="rms", freeze_on_alarm=False):
    """feats: (T, k) for one layer; miss: (T, k) bool."""
    t_steps, k = feats.shape
    if isinstance(log_space, bool):
        log_space = (log_space,) * k
    loc = [0.0] * k
    sc = [0.0] * k
    cnt = [0] * k
    out = []

    def scale_of(j):
        floor = min_scale if log_space[j] else min_scale * abs(loc[j])
        return max(sc[j] * SIG, floor, 1e-300)

    for t in range(t_steps):
        present = [j for j in range(k) if miss is None or not miss[t, j]]
        if not present:
            out.append(math.nan)
            continue
        if any(not math.isfinite(feats[t, j]) for j in present):
            out.append(math.inf)
            continue
        ys = {j: math.log(max(feats[t, j], 1e-30)) if log_space[j] else feats[t, j]
              for j in present}
        zs = [abs(ys[j] - loc[j]) / scale_of(j) for j in present if cnt[j] > 0
              and cnt[j] >= warmup]
        if not zs:
            s = 0.0
        elif aggregate == "max":
            s = max(zs)
        else:
            s = math.sqrt(sum(z * z for z in zs) / len(zs))
        out.append(s)
        if s > threshold and freeze_on_alarm:
            continue
        for j in present:
            y = ys[j]
            if cnt[j] == 0:
                loc[j], sc[j], cnt[j] = y, 0.0, 1
                continue
            r = y - loc[j]
            if cnt[j] >= warmup and math.isfinite(clip):
                lim = clip * scale_of(j)
                r = min(max(r, -lim), lim)
            a = max(alpha, 1 / (cnt[j] + 1))
            loc[j] += a * r
            sc[j] = (1 - a) * sc[j] + a * abs(r)
            cnt[j] += 1
    return np.array(out)


def ref_hist(x, miss=None, window=200, n_bins=10, warmup=0, threshold=1.0, stride=1, refresh=0,
             smoothing=0.5, freeze_on_alarm=False):
    count = 0
    ref: list[float] = []
    cur: list[float] = []  # oldest first
    edges: list[float] = []
    last = 0.0
    since = 0
    out = []

    def build():
        srt = sorted(ref)
        return [srt[0], *[srt[(j * window) // n_bins] for j in range(1, n_bins)], srt[-1]]

    def bin_of(v):
        if v < edges[0]:
            return 0
        if v > edges[-1]:
            return n_bins + 1
        return 1 + bisect.bisect_right(edges[1:-1], v)

    def psi(values):
        rc = [0] * (n_bins + 2)
        cc = [0] * (n_bins + 2)
        for v in ref:
            rc[bin_of(v)] += 1
        for v in values:
            cc[bin_of(v)] += 1
        d = window + (n_bins + 2) * smoothing
        tot = 0.0
        for b in range(n_bins + 2):
            p = (cc[b] + smoothing) / d
            q = (rc[b] + smoothing) / d
            tot += (p - q) * math.log(p / q)
        return tot

    for k, v in enumerate(x):
        if miss is not None and miss[k]:
            out.append(math.nan)
            continue
        if not math.isfinite(v):
            out.append(math.inf)
            continue
        if count < warmup:
            count += 1
            out.append(0.0)
            continue
        if len(ref) < window:
            ref.append(v)
            count += 1
            if len(ref) == window:
                edges = build()
            out.append(0.0)
            continue
        if len(cur) < window:
            cur.append(v)
            count += 1
            if len(cur) < window:
                out.append(0.0)
                continue
            last = psi(cur)
            since += 1
            out.append(last)
            continue
        cand = [*cur[1:], v]
        s = psi(cand) if since % stride == 0 else last
        out.append(s)
        if s > threshold and freeze_on_alarm:
            continue
        cur = cand
        count += 1
        last = s
        since += 1
        if refresh > 0 and since % refresh == 0:
            ref = list(cur)
            edges = build()
    return np.array(out)

# ---------------------------------------------------------------------- adwin


def fdiv(a, b):
    """IEEE division (inf / nan instead of ZeroDivisionError), as in Rust and Numba."""
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def flog(v):
    return -math.inf if v == 0.0 else (math.nan if v < 0.0 else math.log(v))


def fsqrt(v):
    return math.nan if v < 0.0 else math.sqrt(v)


class RefADWIN:
    """Plain-Python port of river's ``rust_src/adwin.rs`` plus river's restart after a drift.

    Rows are Python lists of ``[total, variance]`` (oldest first).  The score is the positive
    part of the largest ``|mean0 - mean1| - eps_cut`` over every cut tested (no screening).
    """

    def __init__(self, delta=0.002, clock=32, max_buckets=5, min_window_length=5,
                 grace_period=10, reset_on_drift=True, max_rows=48):
        self.delta, self.clock, self.mb = delta, clock, max_buckets
        self.mwl, self.gp = float(min_window_length), float(grace_period)
        self.reset_on_drift, self.max_rows = reset_on_drift, max_rows
        self.reset()

    def reset(self):
        self.total = self.variance = self.width = 0.0
        self.tick = 0
        self.rows = [[]]

    def delete(self):
        last = len(self.rows) - 1
        n = float(2**last)
        u, v = self.rows[last][0]
        mu = u / n
        self.width -= n
        self.total -= u
        mw = fdiv(self.total, self.width)
        self.variance -= v + n * self.width * (mu - mw) * (mu - mw) / (n + self.width)
        del self.rows[last][0]
        while len(self.rows) > 1 and not self.rows[-1]:
            self.rows.pop()

    def insert(self, value):
        self.rows[0].append([value, 0.0])
        self.width += 1.0
        inc = 0.0
        if self.width > 1.0:
            d = value - self.total / (self.width - 1.0)
            inc = (self.width - 1.0) * d * d / self.width
        self.variance += inc
        self.total += value
        idx = 0
        while len(self.rows[idx]) == self.mb + 1:
            if idx + 1 == self.max_rows:
                self.delete()
                break
            n1 = float(2**idx)
            (t0, v0), (t1, v1) = self.rows[idx][0], self.rows[idx][1]
            mu1, mu2 = t0 / n1, t1 / n1
            temp = n1 * 0.5 * (mu1 - mu2) * (mu1 - mu2)
            if idx + 1 >= len(self.rows):
                self.rows.append([])
            self.rows[idx + 1].append([t0 + t1, v0 + v1 + temp])
            del self.rows[idx][:2]
            if len(self.rows[idx + 1]) <= self.mb:
                break
            idx += 1

    def update(self, x):
        """Returns (score, drift)."""
        self.insert(x)
        change = False
        best = -math.inf
        self.tick += 1
        if self.tick % self.clock == 0 and self.width > self.gp:
            reduce = True
            while reduce:
                reduce = False
                n0, n1, u0, u1 = 0.0, self.width, 0.0, self.total
                done = False
                for idx in range(len(self.rows) - 1, -1, -1):
                    if done:
                        break
                    size = float(2**idx)
                    row = self.rows[idx]
                    for k in range(len(row)):
                        n0 += size
                        n1 -= size
                        u0 += row[k][0]
                        u1 -= row[k][0]
                        if idx == 0 and k == len(row) - 1:
                            done = True
                            break
                        if n1 >= self.mwl and n0 >= self.mwl:
                            dm = abs(fdiv(u0, n0) - fdiv(u1, n1))
                            dp = flog(2.0 * flog(self.width) / self.delta)
                            m = 1.0 / (n0 - self.mwl + 1.0) + 1.0 / (n1 - self.mwl + 1.0)
                            eps = fsqrt(2.0 * m * (self.variance / self.width) * dp)
                            eps += 2.0 / 3.0 * dp * m
                            if dm - eps > best:
                                best = dm - eps
                            if dm > eps:
                                reduce = change = True
                                if self.width > 0.0:
                                    self.delete()
                                    done = True
                                    break
        if change and self.reset_on_drift:
            self.reset()
        return max(best, 0.0), change


def ref_adwin(x, miss=None, threshold=0.0, **kw):
    ref = RefADWIN(**kw)
    scores, alarms = [], []
    for k, v in enumerate(x):
        if miss is not None and miss[k]:
            scores.append(math.nan)
            alarms.append(False)
        elif not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
        else:
            s, _ = ref.update(float(v))
            scores.append(s)
            alarms.append(s > threshold)
    return np.array(scores), np.array(alarms)

# ---------------------------------------------------------------------- cusum


def ref_cusum(
    x,
    miss=None,
    k=0.5,
    threshold=8.0,
    warmup=100,
    alpha=0.0,
    min_std=1e-6,
    direction="both",
    log_space=False,
    reset_on_alarm=True,
    freeze_on_alarm=False,
):
    """Plain-Python two-sided tabular CUSUM for one series."""
    warm: list[float] = []
    mean = var = 0.0
    s_up = s_down = 0.0
    scores, alarms = [], []
    for j, v in enumerate(x):
        if miss is not None and miss[j]:
            scores.append(math.nan)
            alarms.append(False)
            continue
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        y = math.log(max(v, LOG_FLOOR)) if log_space else v
        if len(warm) < warmup:
            # Welford, written out as in the kernel (a two-pass mean differs in the last ulp)
            warm.append(y)
            d = y - mean
            mean += d / len(warm)
            var += d * (y - mean)
            if len(warm) == warmup:
                var /= warmup - 1
            scores.append(0.0)
            alarms.append(False)
            continue
        std = max(math.sqrt(var), min_std * abs(mean), 1e-300)
        z = (y - mean) / std
        s_up = max(0.0, s_up + (z - k))
        s_down = max(0.0, s_down - (z + k))
        s = {"up": s_up, "down": s_down, "both": max(s_up, s_down)}[direction]
        scores.append(s)
        alarms.append(s > threshold)
        if s > threshold and reset_on_alarm:
            warm, mean, var, s_up, s_down = [], 0.0, 0.0, 0.0, 0.0
        elif alpha > 0 and not (s > threshold and freeze_on_alarm):
            d = y - mean
            mean = mean + alpha * d
            var = (1 - alpha) * (var + d * (alpha * d))
    return np.array(scores), np.array(alarms)

# ---------------------------------------------------------------------- divergence


def ref_tv(loss, val, lmiss, vmiss, alpha=0.05, n_points=5, warmup=4, threshold=3.0,
           min_scale=0.005, freeze_on_alarm=False):
    tm, tc = 0.0, 0
    prev_v = prev_m = None
    has_prev_m = False
    incs: list[float] = []
    nval = 0
    out = []
    for k in range(len(loss)):
        hl, hv = not lmiss[k], not vmiss[k]
        if (hl and not math.isfinite(loss[k])) or (hv and not math.isfinite(val[k])):
            out.append(math.inf)
            continue
        tm2, tc2 = tm, tc
        if hl:
            y = math.log(max(loss[k], 1e-30))
            tm2 = y if tc == 0 else tm + max(alpha, 1 / (tc + 1)) * (y - tm)
            tc2 = tc + 1
        if not hv:
            tm, tc = tm2, tc2
            out.append(math.nan)
            continue
        v = math.log(max(val[k], 1e-30))
        if nval == 0:
            tm, tc = tm2, tc2
            prev_v, prev_m, has_prev_m, nval = v, tm2, tc2 > 0, 1
            out.append(0.0)
            continue
        dv = v - prev_v
        dm = tm2 - prev_m if (tc2 > 0 and has_prev_m) else 0.0
        u = dv - max(dm, 0.0)
        if len(incs) + 1 < warmup:
            score = 0.0
        else:
            win = [*incs[len(incs) - min(len(incs), n_points - 1):], u]
            n = len(win)
            mean = sum(win) / n
            sd = math.sqrt(sum((w - mean) ** 2 for w in win) / (n - 1)) if n > 1 else 0.0
            score = mean * math.sqrt(n) / max(sd, min_scale, 1e-300)
        out.append(score)
        if score > threshold and freeze_on_alarm:
            continue
        tm, tc = tm2, tc2
        incs.append(u)
        prev_v, prev_m, has_prev_m, nval = v, tm2, tc2 > 0, nval + 1
    return np.array(out)


def ref_vs(val, vmiss=None, window=8, warmup=3, threshold=6.0, min_scale=0.01,
           freeze_on_alarm=False):
    prev = None
    diffs: list[float] = []
    out = []
    for k, x in enumerate(val):
        if vmiss is not None and vmiss[k]:
            out.append(math.nan)
            continue
        if not math.isfinite(x):
            out.append(math.inf)
            continue
        v = math.log(max(x, 1e-30))
        if prev is None:
            prev = v
            out.append(0.0)
            continue
        dv = v - prev
        if len(diffs) < warmup:
            s = 0.0
        else:
            med = float(np.median(diffs[-window:]))
            s = dv / max(1.4826 * med, min_scale, 1e-300)
        out.append(s)
        if s > threshold and freeze_on_alarm:
            continue
        diffs.append(abs(dv))
        prev = v
    return np.array(out)

# ---------------------------------------------------------------------- ewma


def ref_ewma(
    x,
    miss=None,
    alpha=0.02,
    warmup=30,
    threshold=6.0,
    log_space=True,
    min_std=0.01,
    direction="up",
    clip=4.0,
    debias=True,
    freeze_on_alarm=False,
):
    """Plain-Python EWMA z-score for one series."""
    mean = var = 0.0
    count = 0
    scores, alarms = [], []
    for k, v in enumerate(x):
        if miss is not None and miss[k]:
            scores.append(math.nan)
            alarms.append(False)
            continue
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        y = math.log(max(v, LOG_FLOOR)) if log_space else v
        if count == 0:
            mean, var, count = y, 0.0, 1
            scores.append(0.0)
            alarms.append(False)
            continue
        floor = min_std if log_space else min_std * abs(mean)
        std = max(math.sqrt(var), floor, 1e-300)
        z = (y - mean) / std
        s = 0.0 if count < warmup else {"up": z, "down": -z, "both": abs(z)}[direction]
        scores.append(s)
        alarms.append(s > threshold)
        if s > threshold and freeze_on_alarm:
            continue
        a = max(alpha, 1.0 / (count + 1)) if debias else alpha
        if count >= warmup and math.isfinite(clip):
            y = min(max(y, mean - clip * std), mean + clip * std)
        d = y - mean
        mean = mean + a * d
        var = (1 - a) * (var + d * a * d)
        count += 1
    return np.array(scores), np.array(alarms)

# ---------------------------------------------------------------------- lr_loss


def ref_jump(x, miss=None, alpha=0.05, warmup=5, threshold=10.0, min_delta=0.01, clip=4.0,
             direction="up", freeze_on_alarm=False):
    prev, has, typ, count = 0.0, False, 0.0, 0
    out = []
    for k, v in enumerate(x):
        if miss is not None and miss[k]:
            out.append(math.nan)
            continue
        if not math.isfinite(v):
            out.append(math.inf)
            continue
        if v <= 0:
            has = False
            out.append(0.0)
            continue
        y = math.log(v)
        if not has:
            prev, has = y, True
            out.append(0.0)
            continue
        d = y - prev
        scale = max(typ, min_delta, 1e-300)
        s = 0.0 if count < warmup else {"up": d, "down": -d, "both": abs(d)}[direction] / scale
        out.append(s)
        if s > threshold and freeze_on_alarm:
            continue
        ad = abs(d)
        if count >= warmup and math.isfinite(clip):
            ad = min(ad, clip * scale)
        a = max(alpha, 1 / (count + 1))
        typ += a * (ad - typ)
        count += 1
        prev = y
    return np.array(out)


def ref_coherent_jump(x, miss=None, alpha=0.05, warmup=20, threshold=10.0, min_delta=0.01,
                      clip=4.0, direction="up", min_series=2, level_alpha=0.05,
                      level_alpha_down=0.005, freeze_on_alarm=False):
    """x: (T, n) bank; returns (T, n) scores: min(own jump score, k-th largest of the step)."""
    x = np.asarray(x, dtype=float)
    t_steps, n = x.shape
    prev, has, typ, count = [0.0] * n, [False] * n, [0.0] * n, [0] * n
    level = [0.0] * n
    out = np.full((t_steps, n), math.nan)
    for t in range(t_steps):
        raw, dl = {}, {}
        for i in range(n):
            v = x[t, i]
            if miss is not None and miss[t, i]:
                continue
            if not math.isfinite(v):
                out[t, i] = math.inf
                continue
            d = math.log(v) - prev[i] if v > 0 and has[i] else None
            if d is None or count[i] < warmup:
                raw[i] = 0.0
            else:
                scale = max(typ[i], min_delta, 1e-300)
                y = math.log(v)
                hi = max(prev[i], level[i]) if level_alpha > 0 else prev[i]
                lo = min(prev[i], level[i]) if level_alpha > 0 else prev[i]
                up, down = (y - hi) / scale, (lo - y) / scale
                raw[i] = {"up": up, "down": down, "both": max(up, down)}[direction]
            dl[i] = d
        if not raw:
            continue
        kth = sorted(raw.values(), reverse=True)[min(min_series, len(raw)) - 1]
        for i, r in raw.items():
            s = min(r, kth)
            out[t, i] = s
            v = x[t, i]
            if v <= 0:
                has[i] = False
                continue
            if s > threshold and freeze_on_alarm:
                continue
            y = math.log(v)
            if dl[i] is not None:
                lim = clip * max(typ[i], min_delta, 1e-300)
                ad, dlev = abs(dl[i]), y - level[i]
                if count[i] >= warmup and math.isfinite(clip):
                    ad, dlev = min(ad, lim), min(max(dlev, -lim), lim)
                a = max(alpha, 1 / (count[i] + 1))
                typ[i] += a * (ad - typ[i])
                rate = level_alpha if dlev >= 0 else level_alpha_down
                level[i] += max(rate, 1 / (count[i] + 2)) * dlev
                count[i] += 1
            elif count[i] == 0:
                level[i] = y
            prev[i], has[i] = y, True
    return out

def ref_corr(loss, lr, window=50, alpha=0.1, min_lr_ratio=1.5, min_lr_std=0.01,
             min_loss_std=1e-4, threshold=0.5, freeze_on_alarm=False):
    y = None
    count = 0
    lrs: list[float] = []
    pairs: list[tuple[float, float]] = []
    out = []
    for ls, lv in zip(loss, lr, strict=True):
        if not (math.isfinite(ls) and math.isfinite(lv)):
            out.append(math.inf)
            continue
        yl = math.log(max(ls, 1e-30))
        if count == 0:
            y, count, lrs = yl, 1, [lv]
            out.append(0.0)
            continue
        a_w = max(alpha, 1 / (count + 1))
        y_new = y + a_w * (yl - y)
        b = y_new - y
        a = 0.0
        if count >= 2 and lrs[-1] > 0 and lrs[-2] > 0:
            a = math.log(lrs[-1]) - math.log(lrs[-2])
        score = 0.0
        win = [*pairs[-(window - 1):], (a, b)] if count >= 2 else []
        if count >= 2 and len(win) == window:
            sa = sum(p[0] for p in win)
            sb = sum(p[1] for p in win)
            if sa >= math.log(min_lr_ratio) and sb > 0:
                ma, mb = sa / window, sb / window
                caa = sum((p[0] - ma) ** 2 for p in win) / window
                cbb = sum((p[1] - mb) ** 2 for p in win) / window
                cab = sum((p[0] - ma) * (p[1] - mb) for p in win) / window
                score = cab / (max(math.sqrt(caa), min_lr_std) * max(math.sqrt(cbb), min_loss_std))
        out.append(score)
        if score > threshold and freeze_on_alarm:
            continue
        if count >= 2:
            pairs.append((a, b))
        y = y_new
        lrs.append(lv)
        count += 1
    return np.array(out)


def ref_level(loss, lr, alpha=0.05, base_alpha=0.01, warmup=100, threshold=4.0, margin=1.2,
              stable_ratio=2.0, min_var=1e-8, freeze_on_alarm=False):
    prev = mean = var = base = maxlr = last_lr = 0.0
    peaked = False
    count = 0
    out = []
    for ls, lv in zip(loss, lr, strict=True):
        if not (math.isfinite(ls) and math.isfinite(lv)):
            out.append(math.inf)
            continue
        y = math.log(max(ls, 1e-30))
        if count == 0:
            prev, maxlr, last_lr, count = y, lv, lv, 1
            out.append(0.0)
            continue
        d = y - prev
        a = max(alpha, 1 / count)
        dd = d - mean
        new_mean = mean + a * dd
        new_var = (1 - a) * (var + a * dd * dd)
        ratio = new_var / max(base, min_var, 1e-300)
        pk = peaked or lv <= last_lr
        warm = count >= warmup and pk
        score = ratio if (warm and last_lr > margin * maxlr) else 0.0
        out.append(score)
        if score > threshold and freeze_on_alarm:
            continue
        prev, mean, var = y, new_mean, new_var
        if not warm:
            b = max(base_alpha, 1 / count)
            base += b * (new_var - base)
            maxlr = max(maxlr, lv)
        else:
            base += base_alpha * (min(new_var, stable_ratio * max(base, min_var)) - base)
            if ratio <= stable_ratio:
                maxlr = max(maxlr, last_lr)
        last_lr, peaked = lv, pk
        count += 1
    return np.array(out)

# ---------------------------------------------------------------------- page_hinkley


def ref_page_hinkley(
    x,
    miss=None,
    min_instances=30,
    delta=0.005,
    threshold=50.0,
    alpha=1 - 0.0001,
    mode="both",
    reset_on_drift=True,
):
    """Plain-Python Page-Hinkley for one series (river's recurrence, written out)."""

    def fresh():
        return {"n": 0.0, "mean": 0.0, "up": 0.0, "down": 0.0, "min": math.inf, "max": -1.0}

    s_ = fresh()
    scores, alarms = [], []
    for k, v in enumerate(x):
        if miss is not None and miss[k]:
            scores.append(math.nan)
            alarms.append(False)
            continue
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        s_["n"] += 1.0
        s_["mean"] += (1.0 / s_["n"]) * (v - s_["mean"])
        dev = v - s_["mean"]
        s_["up"] = alpha * s_["up"] + dev - delta
        s_["down"] = alpha * s_["down"] + dev + delta
        s_["min"] = min(s_["min"], s_["up"])
        s_["max"] = max(s_["max"], s_["down"])
        score = 0.0
        if s_["n"] >= min_instances:
            up, down = s_["up"] - s_["min"], s_["max"] - s_["down"]
            score = {"up": up, "down": down, "both": max(up, down)}[mode]
        scores.append(score)
        alarms.append(score > threshold)
        if score > threshold and reset_on_drift:
            s_ = fresh()
    return np.array(scores), np.array(alarms)

# ---------------------------------------------------------------------- ratio


def ref_ratio(
    x,
    miss=None,
    window=100,
    threshold=2.0,
    patience=3,
    reference="median",
    warmup=None,
    freeze_on_alarm=False,
):
    """Plain-Python ratio-to-reference with patience for one series."""
    if warmup is None:
        warmup = min(window, 30) if reference == "ewm" else window
    win: deque[float] = deque(maxlen=window)
    ratios = deque([0.0] * patience, maxlen=patience)
    ew = mx = 0.0
    count = 0
    scores, alarms = [], []
    for k, v in enumerate(x):
        if miss is not None and miss[k]:
            scores.append(math.nan)
            alarms.append(False)
            continue
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        r = 0.0
        if count >= warmup and count > 0:
            if reference == "mean":
                ref = float(np.mean(win))
            elif reference == "median":
                ref = float(np.median(win))
            else:
                ref = ew if reference == "ewm" else mx
            r = v / max(ref, TINY)
        ratios.append(r)
        s = min(ratios)
        scores.append(s)
        alarms.append(s > threshold)
        if s > threshold and freeze_on_alarm:
            continue
        win.append(v)
        ew += max(2.0 / (window + 1.0), 1.0 / (count + 1.0)) * (v - ew)
        if count == 0:
            mx = v
        elif count < window:
            mx = max(mx, v)
        count += 1
    return np.array(scores), np.array(alarms)

# ---------------------------------------------------------------------- robust


def ref_track_tail(s, alarm, q, event, tail_q, rate, ref, gap):
    """The tail calibration's quantile tracker (TailZScore, RobustZScore), one step in plain
    Python: ``event`` is 0 (none open), +k (open, k quiet scores left, healthy so far) or -k
    (open, alarmed).  A healthy event lifts q by rate * tail_q when it closes; every quiet score
    sinks it by rate * (1 - tail_q); q never goes below ref."""
    if s > q or alarm:
        alarmed = alarm or event < 0
        return q, (-gap if alarmed else gap)
    q -= rate * (1 - tail_q)
    if event:
        left = abs(event) - 1
        if left == 0:
            if event > 0:
                q += rate * tail_q
            event = 0
        else:
            event = left if event > 0 else -left
    return max(q, ref), event


def ref_robust(
    x,
    miss=None,
    window=128,
    warmup=None,
    threshold=8.0,
    robust=True,
    log_space=True,
    min_std=0.01,
    direction="up",
    freeze_on_alarm=False,
    tail_q=0.999,
    tail_rate=1.0,
    tail_max=1.0,
    tail_gap=1,
):
    """Plain-Python windowed z-score for one series (numpy median / mean / std on the window),
    divided by the run's tail factor (quantile tracker of healthy spike events, as TailZScore)."""
    if warmup is None:
        warmup = max(2, window // 4) if window >= 2 else 1
    ref = NormalDist().inv_cdf(tail_q)
    q, above = ref, 0
    win: deque[float] = deque(maxlen=window)
    scores, alarms = [], []
    for k, v in enumerate(x):
        if miss is not None and miss[k]:
            scores.append(math.nan)
            alarms.append(False)
            continue
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        y = math.log(max(v, LOG_FLOOR)) if log_space else v
        s = 0.0
        scoring = len(win) >= warmup and len(win) > 0
        if scoring:
            a = np.array(win)
            if robust:
                center = float(np.median(a))
                spread = MAD_SCALE * float(np.median(np.abs(a - center)))
            else:
                center, spread = float(a.mean()), float(a.std())
            floor = min_std if log_space else min_std * abs(center)
            z = (y - center) / max(spread, floor, 1e-300)
            s = {"up": z, "down": -z, "both": abs(z)}[direction]
        cal = s / max(1.0, min(tail_max, q / ref))
        alarm = cal > threshold
        scores.append(cal)
        alarms.append(alarm)
        if alarm and freeze_on_alarm:
            if scoring:  # the open event alarmed (it will not lift q)
                above = -tail_gap if above == 0 else -abs(above)
            continue
        if scoring:
            q, above = ref_track_tail(s, alarm, q, above, tail_q, tail_rate, ref, tail_gap)
        win.append(y)
    return np.array(scores), np.array(alarms)


# ---------------------------------------------------------------------- nonfinite


def ref_nonfinite(x, miss=None):  # type: ignore[no-untyped-def]
    """NonFiniteGuard: score = 1 on a logged non-finite value, else 0; alarm = score > 0.5."""
    x = np.asarray(x, dtype=float)
    logged = np.ones(x.shape, dtype=bool) if miss is None else ~np.asarray(miss, dtype=bool)
    scores = np.where(logged & ~np.isfinite(x), 1.0, 0.0)
    return scores, scores > 0.5


#: registry name -> naive reference (checked complete by tests/detectors/test_conformance.py)
def ref_overfit(loss, val, lmiss=None, vmiss=None, alpha=0.2, n_points=4, warmup=5,
                threshold=2.0, min_scale=0.02, noise_alpha=0.1, noise_clip=3.0,
                freeze_on_alarm=False):
    """OverfitGap: min gap increment over the last n_points - 1 validation intervals, over
    max(run's noise of the increments, min_scale); the noise from the mean |second
    difference| of the gap (Gaussian scale 1.2533 / sqrt(3) of it), from the third validation
    point on, each winsorised at noise_clip times the current positive estimate."""
    n = len(loss)
    lmiss = np.zeros(n, bool) if lmiss is None else lmiss
    vmiss = np.zeros(n, bool) if vmiss is None else vmiss
    tm, tc = 0.0, 0
    prev_g = None
    incs: list[float] = []
    nval = 0
    noise, n_noise = 0.0, 0
    out = []
    for k in range(n):
        hl, hv = not lmiss[k], not vmiss[k]
        if (hl and not math.isfinite(loss[k])) or (hv and not math.isfinite(val[k])):
            out.append(math.inf)
            continue
        tm2, tc2 = tm, tc
        if hl:
            y = math.log(max(loss[k], 1e-30))
            tm2 = y if tc == 0 else tm + max(alpha, 1 / (tc + 1)) * (y - tm)
            tc2 = tc + 1
        if not hv or tc2 == 0:
            tm, tc = tm2, tc2
            out.append(math.nan if not hv else 0.0)
            continue
        g = math.log(max(val[k], 1e-30)) - tm2
        if nval == 0:
            tm, tc, prev_g, nval = tm2, tc2, g, 1
            out.append(0.0)
            continue
        d = g - prev_g
        if len(incs) + 1 < n_points - 1 or nval + 1 < warmup:
            score = 0.0
        else:
            score = min([d, *incs[len(incs) - (n_points - 2):]] if n_points > 2 else [d])
            sigma = 1.2533141373155001 / math.sqrt(3.0) * noise
            score = score / max(sigma, min_scale, 1e-300)
        out.append(score)
        if score > threshold and freeze_on_alarm:
            continue
        tm, tc, prev_g, nval = tm2, tc2, g, nval + 1
        if len(incs) >= 2:  # the first increment's change is a start-of-training transient
            dd = abs(d - incs[-1])
            if noise > 0:
                dd = min(dd, noise_clip * noise)
            a = max(noise_alpha, 1.0 / (n_noise + 1))
            noise += a * (dd - noise)
            n_noise += 1
        incs.append(d)
    return np.array(out)


REFERENCES = {
    "nonfinite": ref_nonfinite,
    "ewma_z": ref_ewma,
    "robust_z": ref_robust,
    "ratio": ref_ratio,
    "page_hinkley": ref_page_hinkley,
    "adwin": ref_adwin,
    "cusum": ref_cusum,
    "activation_shift": ref_shift,
    "histogram_drift": ref_hist,
    "train_val": ref_tv,
    "val_spike": ref_vs,
    "lr_jump": ref_jump,
    "coherent_jump": ref_coherent_jump,
    "lr_loss_corr": ref_corr,
    "lr_level": ref_level,
    "overfit_gap": ref_overfit,
}
