import json,sys
for f in sys.argv[1:]:
    d=json.load(open(f))
    rows=d.get("rows") or d.get("results") or d
    if isinstance(rows, dict): rows=rows.get("rows", [])
    for r in rows:
        if not isinstance(r, dict) or "variant" not in r: continue
        s=r.get("stats",{})
        print(f'{r.get("workload")} {r["variant"]:12s} ms={r.get("time_ms",0):8.2f} xfloor={r.get("x_floor", r.get("floor_ratio","?"))} bitwise={r.get("bitwise_equal")} traj={r.get("trajectory_bitwise_equal")} store={s.get("host_store")} h2d_gbps={s.get("h2d_gbps", s.get("achieved_h2d_gbps"))} fill_gbps={s.get("bounce_fill_gbps")} wait_ms={s.get("bounce_wait_ms")} peak={r.get("peak_vram_bytes",0)/2**30:.2f}GiB rss/w={r.get("rss_over_weight")} status={r.get("status")}')
