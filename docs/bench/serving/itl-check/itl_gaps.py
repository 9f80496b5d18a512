"""For each inter-token gap > THRESH s in a run's per-request data (--save-detailed), list the
other requests whose first token (end of their prefill) falls inside that gap."""
import json, sys
THRESH = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
d = json.load(open(sys.argv[1]))
starts, ttfts, itls = d["start_times"], d["ttfts"], d["itls"]
first = [s + t for s, t in zip(starts, ttfts)]
t0 = min(starts)
gaps = explained = 0
for i, il in enumerate(itls):
    now = first[i]
    for g in il:
        if g > THRESH:
            gaps += 1
            inside = [j for j in range(len(first)) if j != i and now - 0.05 <= first[j] <= now + g + 0.05]
            explained += bool(inside)
            print(f"req {i}: gap {g:.2f} s at {now - t0:7.1f}-{now + g - t0:7.1f} s; prefills ending inside: {inside}")
        now += g
n_itl = sum(len(x) for x in itls)
print(f"{gaps} gaps > {THRESH} s of {n_itl} inter-token intervals; {explained} contain another request's prefill end")
