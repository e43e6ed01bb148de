"""The bench report: ratios against 1x1, the issue's targets, the table and the plot."""

from __future__ import annotations


def add_ratios(meshes: list[dict]) -> None:
    """time(mesh) / time(1x1) for the same job; meshes[0] is the 1x1 baseline.

    Decode in G > 1 groups also gets time / (G x the 1x1 time at the group's batch,
    where that batch was run): the same groups decoded in turn on one device. Each
    group's step reads the stage's weights again, so on devices that share one memory
    (emulated CPU devices) G groups cost G weight reads per step where 1x1 at the whole
    batch pays one; this ratio leaves that out and keeps the schedule's own overhead."""
    base = meshes[0]
    for kind, key in (("prefill", "prompt_len"), ("decode", "batch")):
        ref = {j[key]: j["time_s"]["median"] for j in base.get(kind, [])}
        for m in meshes:
            for j in m.get(kind, []):
                j["time_ratio_vs_1x1"] = j["time_s"]["median"] / ref[j[key]]
                G = j.get("groups", 1)
                group = j["padded_batch"] // G if G > 1 else None
                if group in ref:
                    j["time_ratio_vs_1x1_groups_in_turn"] = j["time_s"]["median"] / (G * ref[group])


def _find(report, mesh: str, kind: str, key: str, value):
    for m in report.get("meshes", []):
        if m["mesh"] == mesh:
            for j in m.get(kind, []):
                if j[key] == value:
                    return j
    return None


def _target(value, target: float, at_least: bool) -> dict:
    met = None if value is None else (value >= target if at_least else value <= target)
    return {"value": value, "target": (">= " if at_least else "<= ") + str(target), "met": met}


def check_targets(report: dict) -> dict:
    """The issue's targets for this backend (CPU, or a GPU in bfloat16), from whatever
    this run measured (value None: not run)."""
    d1 = _find(report, "1x1", "decode", "batch", 1)
    peer = report.get("peer") or {}

    def peer_speedup(kind, key, value):
        for j in peer.get(kind, []):
            if j[key] == value:
                return j["speedup"]["median"]
        return None

    compiles = [m["compile_s_max"] for m in report.get("meshes", [])]
    if report["machine"]["backend"] == "gpu":
        p8192 = _find(report, "1x1", "prefill", "prompt_len", 8192)
        return {
            "decode_b1_bandwidth_roofline_fraction": _target(
                d1.get("bandwidth_roofline_fraction") if d1 else None, 0.5, True
            ),
            "prefill_8192_compute_roofline_fraction": _target(
                p8192.get("compute_roofline_fraction") if p8192 else None, 0.4, True
            ),
            "decode_b1_speedup_vs_peer": _target(peer_speedup("decode", "batch", 1), 2.0, True),
            "prefill_8192_speedup_vs_peer": _target(
                peer_speedup("prefill", "prompt_len", 8192), 2.0, True
            ),
            "compile_s_max": _target(max(compiles) if compiles else None, 20.0, False),
        }
    serve = _serve_targets(report)
    p2048 = _find(report, "2x2", "prefill", "prompt_len", 2048)
    d8 = _find(report, "2x1", "decode", "batch", 8)
    return {
        "decode_b1_bandwidth_roofline_fraction": _target(
            d1.get("bandwidth_roofline_fraction") if d1 else None, 0.8, True
        ),
        "decode_b1_speedup_vs_peer": _target(peer_speedup("decode", "batch", 1), 1.7, True),
        "prefill_512_speedup_vs_peer": _target(
            peer_speedup("prefill", "prompt_len", 512), 1.5, True
        ),
        "prefill_2048_2x2_time_ratio_vs_1x1": _target(
            p2048["time_ratio_vs_1x1"] if p2048 else None, 1.25, False
        ),
        "decode_b8_2x1_time_ratio_vs_1x1": _target(
            d8["time_ratio_vs_1x1"] if d8 else None, 1.25, False
        ),
        "compile_s_max": _target(max(compiles) if compiles else None, 20.0, False),
        **serve,
        **_embed_targets(report),
    }


def _embed_targets(report: dict) -> dict:
    """The embed scenario's CPU targets (issue 63): input tokens/s on 1x1 at least the
    peer's (sentence-transformers' loop), and a long input's activations and K/V a
    device on 1x4 about a quarter of 1x1's (at most 0.3)."""
    peer = (report.get("peer") or {}).get("embed")
    on4 = next(
        (m["embed"] for m in report.get("meshes", []) if m["mesh"] == "1x4" and "embed" in m), None
    )
    return {
        "embed_1x1_speedup_vs_peer": _target(peer["speedup"] if peer else None, 1.0, True),
        "embed_1x4_memory_ratio_vs_1x1": _target(
            on4["memory_ratio_vs_1x1"] if on4 else None, 0.3, False
        ),
    }


def _serve_targets(report: dict) -> dict:
    """The serve scenario's CPU targets: on 1x1 with 8 rows at concurrency 8, output tokens/s >= 3x
    concurrency 1 and >= 0.8x a static batch of 8 equal-length requests (each the median
    of ratios run back to back); on 2x1 at concurrency >= 2 x rows / G, each stage's
    steady idle fraction (empty rows counted idle) <= 0.1."""

    def loops(mesh):
        for m in report.get("meshes", []):
            if m["mesh"] == mesh and "serve" in m:
                return m["serve"]
        return None

    one, two = loops("1x1"), loops("2x1")
    # the ratios of loops and batches run back to back (`serve._paired`), at 8 rows
    paired = one["paired"] if one and one["paired"]["concurrency"] == 8 else None
    vs_c1 = paired["vs_c1"]["median"] if paired else None
    vs_static = paired["vs_static_equal_batch"]["median"] if paired else None
    idle = None
    if two:
        loaded = [
            j["before_drain"]["stage_idle_fraction"]
            for j in two["concurrency"]
            if j["concurrency"] >= 2 * two["max_batch"] // two["groups"] and j["before_drain"]
        ]
        idle = max(loaded) if loaded else None
    return {
        "serve_c8_vs_c1_1x1": _target(vs_c1, 3.0, True),
        "serve_c8_vs_static_batch_8_1x1": _target(vs_static, 0.8, True),
        "serve_loaded_idle_fraction_2x1": _target(idle, 0.1, False),
    }


def _s(x: dict, scale=1.0, fmt="{:.3g}") -> str:
    return (
        fmt.format(x["median"] * scale)
        + " ("
        + fmt.format(x["min"] * scale)
        + ".."
        + fmt.format(x["max"] * scale)
        + ")"
    )


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def _opt(j: dict, key: str, fmt="{:.3f}") -> str:
    return fmt.format(j[key]) if key in j else "-"


def print_table(r: dict, targets: bool = False) -> None:
    """The report as tables on stdout, one section after another. The targets table is
    the project's yardstick, not the run's result, so it shows only when asked: a row of
    targets this run did not measure reads as a failure to a newcomer."""
    sections = [_header, _prefill, _prefill_cp, _decode, _serve, _memory, _peer]
    for section in sections + ([_targets] if targets else []):
        section(r)


def _header(r: dict) -> None:
    """The machine, the model and the measured rooflines."""
    m = r["machine"]
    print(
        f"\nmachine: {m['cpu_model']} ({m['cpu_cores']} cores), {m['backend']} x"
        f"{m['device_count']} ({m['device_kind']}); jax {m['jax']}, flax {m['flax']}"
    )
    print(
        f"model: {r['model']['name']}; {r['dtype']}; median (min..max) of "
        f"{r['settings']['repeats']} runs"
    )
    if "roofline" in r:
        ro = r["roofline"]
        for link in ro["links"]:
            print(
                f"link over {link['devices']} devices (received per device): ppermute "
                f"{_s(link['ppermute'], 1e-9)} GB/s, all-to-all "
                f"{_s(link['all_to_all'], 1e-9)} GB/s"
            )
        print(
            f"roofline: bandwidth {_s(ro['bandwidth_bytes_per_s'], 1e-9)} GB/s, matmul "
            f"{_s(ro['matmul_flops_per_s'], 1e-9)} GFLOP/s"
        )


def _prefill(r: dict) -> None:
    """Prefill throughput per mesh and prompt length."""
    rows = [
        [
            m["mesh"],
            j["prompt_len"],
            _s(j["tokens_per_s"]),
            _s(j["time_s"]),
            _opt(j, "time_ratio_vs_1x1", "{:.2f}"),
            _opt(j, "compute_roofline_fraction"),
            f"{j['idle_fraction']:.2f}",
            f"{j['stage_bytes_per_token']:.0f}",
            f"{j['ring_bytes_per_token']:.0f}",
            f"{j['compile_s']:.1f}",
        ]
        for m in r["meshes"]
        for j in m.get("prefill", [])
    ]
    if rows:
        print("\nprefill")
        print(
            _table(
                [
                    "mesh",
                    "T",
                    "tokens/s",
                    "time s",
                    "x 1x1",
                    "of FLOP roof",
                    "idle",
                    "stage B/tok",
                    "ring B/tok",
                    "compile s",
                ],
                rows,
            )
        )


def _prefill_cp(r: dict) -> None:
    """Bytes each device receives for attention along seq, and the cost model's time."""
    rows = [
        [
            m["mesh"],
            j["prompt_len"],
            j["cp_strategy"],
            _s(j["time_s"]),
            f"{j['cp_predicted_s']:.3g}",
            f"{j['cp_bytes_per_device']:,}",
            f"{j['cp_bytes_per_device_per_layer']:,}",
        ]
        for m in r["meshes"]
        if m["seq"] > 1
        for j in m.get("prefill", [])
    ]
    if rows:
        print("\nprefill attention along seq (bytes each device receives; cost model's time)")
        print(
            _table(
                ["mesh", "T", "cp", "time s", "predicted s", "bytes/device", "bytes/device/layer"],
                rows,
            )
        )


def _decode(r: dict) -> None:
    """Decode throughput per mesh and batch."""
    rows = [
        [
            m["mesh"],
            j["batch"],
            _s(j["tokens_per_s"]),
            _s(j["time_per_output_token_s"], 1e3),
            _opt(j, "time_ratio_vs_1x1", "{:.2f}"),
            _opt(j, "time_ratio_vs_1x1_groups_in_turn", "{:.2f}"),
            _opt(j, "bandwidth_roofline_fraction"),
            _s(j["host_overhead_fraction"]),
            f"{j['steady_idle_fraction']:.2f}",
            f"{j['stage_bytes_per_token']:.0f}",
            f"{j['ring_bytes_per_token']:.0f}",
            f"{j['compile_s']:.1f}",
        ]
        for m in r["meshes"]
        for j in m.get("decode", [])
    ]
    if rows:
        cache = r["settings"].get("decode_cache_len")
        print(
            f"\ndecode ({r['settings']['decode_steps']} steps after "
            f"{r['settings']['decode_prompt_len']} prompt tokens"
            f"{f', {cache} cache slots per request' if cache else ''})"
        )
        print(
            _table(
                [
                    "mesh",
                    "B",
                    "tokens/s",
                    "ms/token",
                    "x 1x1",
                    "x 1x1 groups in turn",
                    "of BW roof",
                    "host frac",
                    "idle",
                    "stage B/tok",
                    "ring B/tok",
                    "compile s",
                ],
                rows,
            )
        )


def _serve(r: dict) -> None:
    """The closed loops through the scheduler, next to static batches of their requests."""
    rows = []
    for m in r["meshes"]:
        serve = m.get("serve")
        for j in serve["concurrency"] if serve else []:
            rows.append(
                [
                    m["mesh"],
                    j["concurrency"],
                    f"{j['output_tokens_per_s']:.1f}",
                    f"{j['static']['output_tokens_per_s']:.1f}",
                    f"{j['speedup_vs_static']:.2f}",
                    f"{j['requests_per_s']:.2f}",
                    f"{j['time_to_first_token_s']['p50']:.2f}/{j['time_to_first_token_s']['p90']:.2f}",
                    "-"
                    if j["time_per_output_token_s"]["p50"] is None
                    else f"{1e3 * j['time_per_output_token_s']['p50']:.0f}/"
                    f"{1e3 * j['time_per_output_token_s']['p90']:.0f}",
                    f"{j['row_occupancy']:.2f}",
                    f"{j['stage_idle_fraction']:.2f}",
                    "-"
                    if j["before_drain"] is None
                    else f"{j['before_drain']['stage_idle_fraction']:.2f}",
                ]
            )
    if not rows:
        return
    s = r["settings"]
    print(
        f"\nserve (closed loop; prompts {s['serve_prompt_lens'][0]}-{s['serve_prompt_lens'][1]}, "
        f"outputs {s['serve_output_lens'][0]}-{s['serve_output_lens'][1]} tokens; static = "
        f"the same requests through generate in batches of min(c, rows))"
    )
    head = ["mesh", "c", "tok/s", "static tok/s", "x static", "req/s", "TTFT s p50/p90"]
    head += ["TPOT ms p50/p90", "rows busy", "stages idle", "before the drain"]
    print(_table(head, rows))
    for m in r["meshes"]:
        if m.get("serve"):
            p = m["serve"]["paired"]
            each = [
                ", ".join(f"{x:.2f}" for x in p[k]["each"])
                for k in ("vs_c1", "vs_static_equal_batch")
            ]
            print(
                f"{m['mesh']} back to back: c={p['concurrency']} / c=1 "
                f"{p['vs_c1']['median']:.2f}x ({each[0]}), / the static batch of "
                f"{p['concurrency']} equal requests {p['vs_static_equal_batch']['median']:.2f}x "
                f"({each[1]})"
            )


def _memory(r: dict) -> None:
    """Weights, KV cache and XLA's buffers per device, per compiled program."""
    rows = []
    for m in r["meshes"]:
        if "memory" in m:
            mem = m["memory"]
            for name, a in mem["programs"].items():
                a = a or {}
                rows.append(
                    [
                        m["mesh"],
                        name,
                        f"{mem['max_weight_bytes'] / 2**20:.1f}",
                        f"{mem['max_kv_bytes'] / 2**20:.1f}",
                        f"{a.get('temp_size_in_bytes', 0) / 2**20:.1f}",
                        f"{a.get('argument_size_in_bytes', 0) / 2**20:.1f}",
                        f"{a.get('output_size_in_bytes', 0) / 2**20:.1f}",
                        f"{a.get('alias_size_in_bytes', 0) / 2**20:.1f}",
                    ]
                )
    if rows:
        print("\nmemory per device (MiB)")
        print(
            _table(
                ["mesh", "program", "weights", "KV", "XLA temp", "args", "outputs", "aliased"], rows
            )
        )


def _peer(r: dict) -> None:
    """Our tokens/s against transformers', pair by pair."""
    peer = r.get("peer")
    if peer:
        print(
            f"\npeer: transformers {peer['transformers']} (torch {peer['torch']}, "
            f"{peer['threads']} threads); speedup = our tokens/s / theirs, pair by pair"
        )
        rows = [
            [
                "prefill",
                f"T={j['prompt_len']}",
                _s(j["ours_tokens_per_s"]),
                _s(j["theirs_tokens_per_s"]),
                _s(j["speedup"], fmt="{:.2f}"),
            ]
            for j in peer.get("prefill", [])
        ]
        rows += [
            [
                "decode",
                f"B={j['batch']}",
                _s(j["ours_tokens_per_s"]),
                _s(j["theirs_tokens_per_s"]),
                _s(j["speedup"], fmt="{:.2f}"),
            ]
            for j in peer.get("decode", [])
        ]
        print(_table(["job", "size", "ours tok/s", "transformers tok/s", "speedup"], rows))


def _targets(r: dict) -> None:
    """The issue's targets and whether this run met them."""
    rows = [
        [
            k,
            "-" if t["value"] is None else f"{t['value']:.3g}",
            t["target"],
            {True: "yes", False: "NO", None: "not run"}[t["met"]],
        ]
        for k, t in r["targets"].items()
    ]
    print("\ntargets")
    print(_table(["target", "value", "want", "met"], rows))


def plot(r: dict, path: str) -> None:
    """Prefill and decode throughput per mesh, and the pipeline timelines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in r["meshes"] if m["stage"] > 1] or r["meshes"][:1]
    fig, axes = plt.subplots(
        2,
        2 + len(shown) - 1 if len(shown) > 1 else 2,
        figsize=(6 * max(2, len(shown)), 8),
        squeeze=False,
    )
    ax = axes[0][0]
    for m in r["meshes"]:
        if m.get("prefill"):
            ax.plot(
                [j["prompt_len"] for j in m["prefill"]],
                [j["tokens_per_s"]["median"] for j in m["prefill"]],
                "o-",
                label=m["mesh"],
            )
    if r.get("peer", {}).get("prefill"):
        ax.plot(
            [j["prompt_len"] for j in r["peer"]["prefill"]],
            [j["theirs_tokens_per_s"]["median"] for j in r["peer"]["prefill"]],
            "k--",
            label="transformers",
        )
    ax.set(xscale="log", xlabel="prompt length", ylabel="prefill tokens/s", title="prefill")
    ax = axes[0][1]
    for m in r["meshes"]:
        if m.get("decode"):
            ax.plot(
                [j["batch"] for j in m["decode"]],
                [j["tokens_per_s"]["median"] for j in m["decode"]],
                "o-",
                label=m["mesh"],
            )
    ax.set(xscale="log", xlabel="batch", ylabel="decode tokens/s", title="decode")
    for n, m in enumerate(shown):
        ax = axes[1][n]
        grid = m["timeline"]["decode"]
        cells = [[-1 if c is None else c for c in row] for row in grid]
        ax.imshow(cells, aspect="auto", cmap="tab10", vmin=-1, vmax=9, interpolation="nearest")
        ax.set(
            xlabel="tick",
            ylabel="stage",
            title=f"decode timeline {m['mesh']} (colour = group, dark = idle)",
        )
    for row in axes:
        for ax in row:
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
            if not ax.has_data():
                ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_http(r: dict) -> None:
    """bench --url: each endpoint's load, concurrency by concurrency, and the target."""

    def ms(p: dict) -> str:
        return "-" if p["p50"] is None else f"{1e3 * p['p50']:.0f}/{1e3 * p['p99']:.0f}"

    s = r["settings"]
    print(
        f"\nserve over HTTP ({r['model']}; prompts {s['serve_prompt_lens'][0]}-"
        f"{s['serve_prompt_lens'][1]}, outputs {s['serve_output_lens'][0]}-"
        f"{s['serve_output_lens'][1]} tokens; latencies p50/p99)"
    )
    rows = [
        [
            e["name"],
            j["concurrency"],
            j["requests"],
            f"{j['output_tokens_per_s']:.1f}",
            f"{j['requests_per_s']:.2f}",
            ms(j["ttft_s"]),
            ms(j["tpot_s"]),
            ms(j["itl_s"]),
            j["failed"],
        ]
        for e in r["http"]["endpoints"]
        for j in e["concurrency"]
    ]
    head = ["endpoint", "c", "requests", "tok/s", "req/s", "TTFT ms", "TPOT ms", "ITL ms"]
    print(_table(head + ["failed"], rows))
    for name, t in r["http"]["targets"].items():
        print(
            f"{name}: {t['value']:.2f} (target >= {t['target']}): {'met' if t['met'] else 'NOT met'}"
        )
