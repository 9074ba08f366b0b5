"""`mtrain compare RUN_DIR... | --wandb ENTITY/PROJECT --runs ID,...`: a side-by-side table of runs, their eval
scores, and loss and throughput plots against tokens.

Sources, all read offline unless `--wandb` is given:
- a run folder (`train.output_dir`): its `metrics.jsonl` and resolved `config.yaml`;
- an offline wandb run (`RUN_DIR/wandb/offline-run-*`, its `run-ID.wandb` file, or `RUN_DIR/wandb`, or a run
  folder that has only `wandb/`): the history, config and name read from the `.wandb` transaction log with the
  record format of `wandb.proto` (no wandb process, no network);
- `--wandb ENTITY/PROJECT --runs ID,...`: runs fetched through wandb's public API, under a deadline.
The eval scores found beside a run (`RUN_DIR/eval/results.json`, what `mtrain eval` writes) join the table. A
run that continues another compared run (its `model.path` is that run's `final/` or a checkpoint of it) is
plotted on the token axis continuing the other's: stage 2 after stage 1.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import struct
import threading
import zlib
from pathlib import Path

from mtrain.atomic import atomic_path
from mtrain.errors import MtrainError

REQUIRED = ("step", "tokens", "loss", "tokens_per_s")


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and prefix == "":
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def summarize(source: str | Path) -> dict:
    """Steps, tokens, final/best loss, throughput, memory, attention and eval figures of one run: a run folder
    (metrics.jsonl), or an offline wandb run (an `offline-run-*` folder, its `.wandb` file, a `wandb/` folder,
    or a run folder that holds only `wandb/`)."""
    run_dir = Path(source)
    if run_dir.is_file() and run_dir.suffix == ".wandb":
        return _summary(**_read_wandb_runs([run_dir], str(run_dir)))
    if not run_dir.is_dir():
        raise MtrainError(f"{run_dir}: no such run folder; give train.output_dir folders or offline wandb run "
                          "folders (RUN_DIR/wandb/offline-run-*)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        files = _wandb_files(run_dir)
        if files:
            return _summary(**_read_wandb_runs(files, str(run_dir)))
        raise MtrainError(f"{run_dir} has no metrics.jsonl (nor a wandb/offline-run-* log); is it a "
                          "train.output_dir?")
    return _summary(**_read_local(run_dir, path))


def _read_local(run_dir: Path, path: Path) -> dict:
    import yaml

    from mtrain.train.metrics import read_metrics

    rows = read_metrics(path)
    if not rows:
        raise MtrainError(f"{path} holds no complete steps yet")
    for number, row in enumerate(rows, 1):
        bad = [k for k in REQUIRED if not isinstance(row, dict) or isinstance(row.get(k), bool)
               or not isinstance(row.get(k), (int, float))]
        if bad:
            raise MtrainError(f"{path}: record {number} lacks numeric {bad}; it was not written by `mtrain train`: "
                              "delete that line")
    config_file = run_dir / "config.yaml"
    try:
        config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.exists() else {}
    except yaml.YAMLError as exc:
        raise MtrainError(f"{config_file}: not valid YAML ({' '.join(str(exc).split())}); restore it") from None
    if not isinstance(config, dict):
        raise MtrainError(f"{config_file}: not a recipe (a mapping of sections); restore it")
    return {"name": run_dir.name, "path": str(run_dir), "rows": rows, "config": config,
            "eval": _eval_results(run_dir), "source": "metrics.jsonl"}


# ---- offline wandb runs: the .wandb transaction log (a leveldb-style log of wandb.proto Records) ----------

_WANDB_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_CRC_SEED = {t: zlib.crc32(bytes([t])) for t in (_FULL, _FIRST, _MIDDLE, _LAST)}


def _wandb_files(folder: Path) -> list[Path]:
    """The `.wandb` logs of an offline-run folder, of a `wandb/` folder's offline runs, or of RUN_DIR/wandb."""
    own = sorted(folder.glob("run-*.wandb"))
    if own:
        return own
    for base in (folder, folder / "wandb"):
        found = sorted(base.glob("offline-run-*/run-*.wandb")) + sorted(base.glob("run-*/run-*.wandb"))
        if found:
            return sorted(found, key=lambda f: f.parent.name.split("-", 2)[-1])  # YYYYMMDD_HHMMSS-ID: time order
    return []


def read_wandb_records(path: str | Path):
    """Yield the `wandb.proto` Records of one `.wandb` file; a torn or damaged tail (a run still writing, or
    killed) ends the scan, like the torn last line of metrics.jsonl."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    data = path.read_bytes()
    if data[:len(_WANDB_HEADER)] != _WANDB_HEADER:
        raise MtrainError(f"{path}: not a wandb run log (no :W&B header); give the offline-run-* folder that "
                          "`logging.wandb: offline` wrote")
    pos, pending = len(_WANDB_HEADER), None
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        if kind not in _CRC_SEED or len(chunk) < length or zlib.crc32(chunk, _CRC_SEED[kind]) != checksum:
            return
        pos += 7 + length
        if kind == _FULL:
            payload = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif pending is None:
            return
        elif kind == _MIDDLE:
            pending += chunk
            continue
        else:
            payload, pending = pending + chunk, None
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: a damaged record ends the scan
            return
        yield record


def _item_key(item) -> str:
    return item.key or ".".join(item.nested_key)


def _read_wandb_runs(files: list[Path], where: str) -> dict:
    """History, config and name of one wandb run from its `.wandb` logs in time order (a resumed run writes one
    offline-run folder per attempt; a later attempt's steps replace an earlier one's)."""
    by_step: dict[int, dict] = {}
    config: dict = {}
    run_ids, name = set(), None
    for path in files:
        for record in read_wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(record.run.run_id)
                name = record.run.display_name or name
                for item in record.run.config.update:
                    config[_item_key(item)] = _json(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    config[_item_key(item)] = _json(item.value_json)
            elif kind == "history":
                row = {_item_key(i): _json(i.value_json) for i in record.history.item}
                step = record.history.step.num if record.history.HasField("step") else row.get("_step")
                row["step"] = step
                if all(_numeric(row.get(k)) for k in REQUIRED):
                    by_step[int(step)] = row
    if len(run_ids) > 1:
        raise MtrainError(f"{where}: holds wandb runs {sorted(run_ids)}; give one offline-run-* folder")
    if not by_step:
        raise MtrainError(f"{where}: its wandb log holds no training steps (step, tokens, loss, tokens_per_s) "
                          "yet; give a run `mtrain train` logged with logging.wandb: offline")
    config.pop("_wandb", None)
    run_id = next(iter(run_ids), "?")
    folder = files[0].parent
    run_dir = folder.parent.parent if folder.parent.name == "wandb" else None
    return {"name": name or (run_dir.name if run_dir else f"wandb-{run_id}"), "path": where,
            "rows": [by_step[s] for s in sorted(by_step)], "config": config,
            "eval": _eval_results(run_dir) if run_dir else None, "source": f"wandb offline {run_id}"}


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- the wandb public API (only with --wandb, online) -------------------------------------------------------

def _have_wandb_key() -> bool:
    """WANDB_API_KEY or a `wandb login` entry in ~/.netrc (what `logging.wandb: online` needs too)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return "api.wandb.ai" in Path(os.environ.get("NETRC", Path.home() / ".netrc")).read_text()
    except OSError:
        return False


def fetch_wandb_runs(project: str, ids: list[str], timeout: float) -> list[dict]:
    """Runs ENTITY/PROJECT/ID through `wandb.Api`, all within `timeout` seconds (a thread under a deadline:
    a stalled connection is abandoned, never waited on)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        raise MtrainError(f"--wandb {project}: WANDB_MODE={os.environ['WANDB_MODE']} forbids the network; unset "
                          "it, or compare the offline run folders (RUN_DIR/wandb/offline-run-*) instead")
    if not _have_wandb_key():
        raise MtrainError(f"--wandb {project}: no wandb API key; set WANDB_API_KEY or run `wandb login`, or compare "
                          "the offline run folders (RUN_DIR/wandb/offline-run-*) instead")
    result: dict = {}

    def work():
        try:
            import wandb

            api = wandb.Api(timeout=max(1, int(timeout)))
            runs = []
            for run_id in ids:
                run = api.run(f"{project}/{run_id}")
                rows = [dict(r, step=r.get("_step")) for r in run.scan_history()]
                runs.append({"id": run_id, "name": run.name or run_id, "rows": rows, "config": dict(run.config)})
            result["runs"] = runs
        except Exception as exc:  # noqa: BLE001 - reported below as one line
            result["error"] = exc

    thread = threading.Thread(target=work, daemon=True, name="wandb-api")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise MtrainError(f"--wandb {project}: no answer from the wandb API within {timeout:g} s; check the "
                          "network or raise --wandb-timeout")
    if "error" in result:
        exc = result["error"]
        raise MtrainError(f"--wandb {project} --runs {','.join(ids)}: the wandb API failed "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); check the entity/project "
                          "and run ids")
    summaries = []
    for run in result["runs"]:
        rows = [r for r in run["rows"] if all(_numeric(r.get(k)) for k in REQUIRED)]
        if not rows:
            raise MtrainError(f"--wandb {project} --runs {run['id']}: no training steps (step, tokens, loss, "
                              "tokens_per_s) logged; give runs that `mtrain train` logged")
        config = {k: v for k, v in run["config"].items() if k != "_wandb"}
        summaries.append(_summary(name=run["name"], path=f"wandb:{project}/{run['id']}", rows=rows, config=config,
                                  eval=None, source="wandb api"))
    return summaries


# ---- figures -------------------------------------------------------------------------------------------------

def _mean(values):
    values = [v for v in values if _numeric(v)]
    return sum(values) / len(values) if values else None


def _steady(rows: list[dict], key: str):
    """Median of a per-step speed over the steps after the first (step 1 includes warm-up)."""
    values = [r.get(key) for r in (rows[1:] or rows)]
    values = [v for v in values if _numeric(v)]
    return statistics.median(values) if values else None


def _summary(*, name: str, path: str, rows: list[dict], config: dict, eval: dict | None, source: str) -> dict:
    peaks = [r.get("peak_mem_gb") for r in rows if _numeric(r.get("peak_mem_gb"))]
    recall_min = [r.get("attention_true_recall_min") for r in rows if _numeric(r.get("attention_true_recall_min"))]
    return {
        "run": name,
        "path": path,
        "source": source,
        "steps": rows[-1]["step"],
        "tokens": rows[-1]["tokens"],
        "final_loss": rows[-1]["loss"],
        "best_loss": min(r["loss"] for r in rows),
        "tokens_per_s": _steady(rows, "tokens_per_s"),
        "tflops": _steady(rows, "tflops"),
        "peak_mem_gb": max(peaks) if peaks else None,
        "attention_density": _mean(r.get("attention_density") for r in rows),
        "true_recall": _mean(r.get("attention_true_recall") for r in rows),
        "true_recall_min": min(recall_min) if recall_min else None,
        "imbalance_worker": _mean(r.get("imbalance_worker") for r in rows),
        "imbalance_step": _mean(r.get("imbalance_step") for r in rows),
        "rows": rows,
        "config": _flatten(config),
        "eval": eval,
    }


def loss_at(rows: list[dict], tokens: float):
    """The loss of the last logged step at or before `tokens` (None if the run logged none that early)."""
    before = [r for r in rows if r["tokens"] <= tokens]
    return before[-1]["loss"] if before else None


def _eval_results(run_dir: Path) -> dict | None:
    """The run's `eval/results.json` (what `make eval` writes), or None if it has none."""
    path = run_dir / "eval" / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
    except ValueError:
        raise MtrainError(f"{path}: not valid JSON; rerun `mtrain eval ... --score-only --out {path.parent}`") from None
    return results if isinstance(results, dict) else None


def _unique_names(summaries: list[dict]) -> None:
    """Two sources named alike (a run folder and its own wandb log) get their source added to the name."""
    names = [s["run"] for s in summaries]
    for s in summaries:
        if names.count(s["run"]) > 1 and s["source"] != "metrics.jsonl":
            s["run"] = f"{s['run']} ({s['source']})"


def token_offsets(summaries: list[dict]) -> list[int]:
    """Tokens each run starts at on a shared axis: a run whose model.path lies inside another compared run's
    folder (its final/ export or a checkpoint) starts where that run ended, recursively; others at 0."""
    folders = [os.path.realpath(s["path"]) for s in summaries]

    def parent(i: int) -> int | None:
        model = summaries[i]["config"].get("model.path")
        if not isinstance(model, str):
            return None
        model = os.path.realpath(model)
        for j, folder in enumerate(folders):
            if j != i and (model == folder or model.startswith(folder + os.sep)):
                return j
        return None

    def offset(i: int, seen: frozenset) -> int:
        j = parent(i)
        if j is None or j in seen:
            return 0
        return offset(j, seen | {i}) + summaries[j]["tokens"]

    return [offset(i, frozenset()) for i in range(len(summaries))]


def differing_keys(summaries: list[dict]) -> list[str]:
    keys = sorted({k for s in summaries for k in s["config"]})
    return [k for k in keys if len({repr(s["config"].get(k)) for s in summaries}) > 1]


def common_tokens(summaries: list[dict]) -> int | None:
    """The tokens every compared run reached (each on its own axis): where their losses are compared alike."""
    return min(s["tokens"] for s in summaries) if len(summaries) > 1 else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_data(summaries: list[dict]) -> tuple[list[str], list[str], list[list], list[list[str]]]:
    """Headers, CSV headers, raw values (for CSV) and printed cells of the run table: figures, then config keys that differ."""
    diff = [k for k in differing_keys(summaries) if k != "train.output_dir"]
    common = common_tokens(summaries)
    figures = [  # (header, csv header, value of a summary, format)
        ("run", "run", lambda s: s["run"], "s"),
        ("steps", "steps", lambda s: s["steps"], "d"),
        ("tokens", "tokens", lambda s: s["tokens"], ",d"),
        ("final loss", "final_loss", lambda s: s["final_loss"], ".4f"),
        ("best loss", "best_loss", lambda s: s["best_loss"], ".4f"),
    ]
    if common is not None:
        figures.append((f"loss @{common:,} tok", f"loss_at_{common}_tokens", lambda s: loss_at(s["rows"], common),
                        ".4f"))
    figures += [
        ("tokens/s", "tokens_per_s", lambda s: s["tokens_per_s"], ",.0f"),
        ("TFLOP/s", "tflops", lambda s: s["tflops"], ".3g"),
        ("peak mem GB", "peak_mem_gb", lambda s: s["peak_mem_gb"], ".2f"),
        ("attn density", "attention_density", lambda s: s["attention_density"], ".3f"),
        ("true recall", "true_recall", lambda s: s["true_recall"], ".3f"),
        ("imbalance w/s", None, None, None),
    ]
    headers, csv_headers = [], []
    for header, name, _, _ in figures:
        headers.append(header)
        csv_headers += ["imbalance_worker", "imbalance_step"] if name is None else [name]
    headers += diff
    csv_headers += diff + ["true_recall_min", "source", "path"]
    raw, cells = [], []
    for s in summaries:
        values, printed = [], []
        for _, name, get, spec in figures:
            if name is None:  # imbalance: worker and ring-step max/mean ratios, mean over logged steps
                worker, step = s["imbalance_worker"], s["imbalance_step"]
                values += [worker, step]
                printed.append("-" if worker is None and step is None else f"{_fmt(worker, '.3f')}/{_fmt(step, '.3f')}")
                continue
            value = get(s)
            if spec == "d" or spec == ",d":
                value = int(value)
            values.append(value)
            printed.append(_fmt(value, spec))
        configs = [s["config"].get(k) for k in diff]
        raw.append(values + configs + [s["true_recall_min"], s["source"], s["path"]])
        cells.append(printed + ["-" if v is None else str(v) for v in configs])
    return headers, csv_headers, raw, cells


def _aligned(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_table(summaries: list[dict]) -> str:
    headers, _, _, cells = table_data(summaries)
    return _aligned(headers, cells)


def eval_columns(summaries: list[dict]) -> list[tuple[str, str, str]]:
    """(header, kind, length) of the NIAH (mean over depths) and RULER average columns the runs' evals hold."""
    columns: list[tuple[str, str, str]] = []
    for kind, label in (("niah", "NIAH"), ("ruler", "RULER avg")):
        lengths = sorted({int(L) for s in summaries if s["eval"] for L in (s["eval"].get(kind) or {})})
        columns += [(f"{label} {_length_label(L)}", kind, str(L)) for L in lengths]
    return columns


def eval_score(results: dict | None, kind: str, length: str):
    value = ((results or {}).get(kind) or {}).get(length)
    if not isinstance(value, dict):
        return None
    if kind == "niah":
        scores = [v for v in value.values() if _numeric(v)]
        return sum(scores) / len(scores) if scores else None
    return value.get("average") if _numeric(value.get("average")) else None


def eval_stderr(results: dict | None, kind: str, length: str):
    """The standard error `eval_score`'s figure carries (`mtrain.eval.scoring`): NIAH's over every sample of the
    length, RULER's average over its tasks; None where the results hold none (older results, one sample)."""
    if kind == "niah":
        cell = (((results or {}).get("tasks") or {}).get("niah") or {}).get(length)
    else:
        cell = ((results or {}).get(kind) or {}).get(length)
    value = cell.get("stderr") if isinstance(cell, dict) else None
    return value if _numeric(value) else None


def _score_cell(results: dict | None, kind: str, length: str) -> str:
    score, err = eval_score(results, kind, length), eval_stderr(results, kind, length)
    return _fmt(score, ".1f") if score is None or err is None else f"{score:.1f} ±{err:.1f}"


def format_eval_table(summaries: list[dict]) -> str | None:
    """NIAH (mean over depths) and RULER average per length, one row per run that has eval results; None if
    no run has any. A dash marks a length a run was not evaluated at; "±" gives the standard error of the mean
    over the samples, where the results carry it."""
    with_eval = [s for s in summaries if s["eval"]]
    columns = eval_columns(with_eval)
    if not with_eval or not columns:
        return None
    headers = ["run"] + [c[0] for c in columns]
    rows = [[s["run"]] + [_score_cell(s["eval"], kind, L) for _, kind, L in columns] for s in with_eval]
    return _aligned(headers, rows)


def _length_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def _atomic_write(out: str | Path, write) -> Path:
    """Write through a temporary file beside `out`, then rename: a reader never sees a half-written file."""
    with atomic_path(out) as tmp:
        write(tmp)
    return Path(out)


def _save(fig, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        return _atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(summaries: list[dict], out: str | Path) -> Path:
    """Training loss against tokens, a continued run starting where its parent ended."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, start in zip(summaries, token_offsets(summaries)):
        label = s["run"] if not start else f"{s['run']} (from {start:,} tokens)"
        ax.plot([start + r["tokens"] for r in s["rows"]], [r["loss"] for r in s["rows"]], label=label)
    ax.set_xlabel("tokens (a continued run starts where its parent run ended)")
    ax.set_ylabel("training loss")
    ax.set_title("loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, out)


def plot_throughput(summaries: list[dict], out: str | Path) -> Path:
    """Tokens/s (and TFLOP/s per GPU where logged) against tokens; step 1, the warm-up, left out."""
    plt = _pyplot()
    with_tflops = any(_numeric(r.get("tflops")) for s in summaries for r in s["rows"])
    fig, axes = plt.subplots(2 if with_tflops else 1, 1, figsize=(7, 7 if with_tflops else 4.5), sharex=True,
                             squeeze=False)
    axes = axes[:, 0]
    for s, start in zip(summaries, token_offsets(summaries)):
        rows = s["rows"][1:] or s["rows"]
        axes[0].plot([start + r["tokens"] for r in rows], [r["tokens_per_s"] for r in rows], label=s["run"],
                     marker="." if len(rows) < 50 else None)
        if with_tflops:
            points = [(start + r["tokens"], r["tflops"]) for r in rows if _numeric(r.get("tflops"))]
            axes[1].plot([p[0] for p in points], [p[1] for p in points], label=s["run"],
                         marker="." if len(points) < 50 else None)
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("throughput vs tokens (step 1, the warm-up, left out)")
    if with_tflops:
        axes[1].set_ylabel("TFLOP/s per device")
    axes[-1].set_xlabel("tokens (a continued run starts where its parent run ended)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return _save(fig, out)


def write_csv(summaries: list[dict], out: str | Path) -> Path:
    """One row per run: the table's figures (unrounded), the differing config keys, then the eval scores."""
    _, headers, raw, _ = table_data(summaries)
    columns = eval_columns(summaries)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(headers + [f"{'niah' if kind == 'niah' else 'ruler_avg'}_{L}" for _, kind, L in columns])
    for s, values in zip(summaries, raw):
        cells = values + [eval_score(s["eval"], kind, L) for _, kind, L in columns]
        writer.writerow(["" if v is None else v if isinstance(v, (int, float, str)) else json.dumps(v)
                         for v in cells])
    return _atomic_write(out, lambda tmp: tmp.write_text(buffer.getvalue()))


def format_markdown(summaries: list[dict]) -> str:
    headers, _, _, cells = table_data(summaries)
    columns = eval_columns(summaries)
    headers = headers + [c[0] for c in columns]
    cells = [row + [_fmt(eval_score(s["eval"], kind, L), ".1f") for _, kind, L in columns]
             for s, row in zip(summaries, cells)]
    esc = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def write_markdown(summaries: list[dict], out: str | Path) -> Path:
    return _atomic_write(out, lambda tmp: tmp.write_text(format_markdown(summaries)))


def _default_throughput_plot(loss_plot: str) -> str:
    path = Path(loss_plot)
    stem = path.stem[: -len("-loss")] if path.stem.endswith("-loss") else path.stem
    return str(path.with_name(f"{stem}-throughput.png"))


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare runs (local, offline wandb, or the wandb API): a table, eval scores and plots",
        description="Print, for each run, steps, tokens, final and best loss, the loss at the tokens all runs "
        "reached, tokens/s and TFLOP/s (median after step 1), peak memory, attention density, true recall, ring "
        "imbalance (worker/step) and the config keys that differ; the NIAH and RULER scores of runs with "
        "RUN_DIR/eval/results.json; write loss-vs-tokens and throughput-vs-tokens PNGs (a run continuing another "
        "compared run starts where that one ended). RUN_DIR is a train.output_dir or an offline wandb run "
        "(RUN_DIR/wandb/offline-run-*), read offline; --wandb reads runs through the wandb API.",
    )
    p.add_argument("runs", nargs="*", metavar="RUN_DIR",
                   help="train.output_dir folders, or offline wandb runs (RUN_DIR/wandb/offline-run-*, RUN_DIR/wandb)")
    p.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also compare runs of this wandb project (online)")
    p.add_argument("--runs", dest="wandb_runs", metavar="ID,...", help="the wandb run ids to read with --wandb")
    p.add_argument("--wandb-timeout", type=float, default=60.0, metavar="S",
                   help="give up on the wandb API after this many seconds (default: %(default)s)")
    p.add_argument("--plot", default="compare-loss.png", help="loss PNG to write (default: %(default)s)")
    p.add_argument("--throughput-plot", metavar="PNG",
                   help="throughput PNG to write (default: the --plot name with -throughput for -loss)")
    p.add_argument("--csv", metavar="PATH", help="also write the table (and eval scores) as CSV")
    p.add_argument("--markdown", metavar="PATH", help="also write the table (and eval scores) as a Markdown table")
    p.set_defaults(func=run)


def _check_output(flag: str, value: str | None, suffix: str | None = None) -> None:
    if value is None:
        return
    path = Path(value)
    if path.is_dir() or (suffix and not value.lower().endswith(suffix)):
        raise MtrainError(f"{flag} {value}: name a {suffix + ' ' if suffix else ''}file to write")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise MtrainError(f"{flag} {value}: {parent} is a file, not a folder; choose another path")


def run(args) -> int:
    throughput = args.throughput_plot or _default_throughput_plot(args.plot)
    _check_output("--plot", args.plot, ".png")
    _check_output("--throughput-plot", throughput, ".png")
    _check_output("--csv", args.csv)
    _check_output("--markdown", args.markdown)
    outputs = [os.path.realpath(p) for p in (args.plot, throughput, args.csv, args.markdown) if p]
    if len(set(outputs)) < len(outputs):
        raise MtrainError("--plot, --throughput-plot, --csv and --markdown name the same file; give each its own")
    ids = [i.strip() for i in (args.wandb_runs or "").split(",") if i.strip()]
    if args.wandb_runs is not None and not args.wandb:
        raise MtrainError("--runs names wandb run ids: give --wandb ENTITY/PROJECT with it")
    if args.wandb is not None:
        if args.wandb.count("/") != 1 or not all(args.wandb.split("/")):
            raise MtrainError(f"--wandb {args.wandb}: give ENTITY/PROJECT, e.g. --wandb my-team/mtrain")
        if not ids:
            raise MtrainError(f"--wandb {args.wandb}: give the run ids to compare with --runs ID,...")
        if not args.wandb_timeout > 0:
            raise MtrainError(f"--wandb-timeout {args.wandb_timeout:g}: give a positive number of seconds")
    if not args.runs and not ids:
        raise MtrainError("nothing to compare: give RUN_DIR folders and/or --wandb ENTITY/PROJECT --runs ID,...")
    summaries = [summarize(r) for r in args.runs]
    if args.wandb is not None:
        summaries += fetch_wandb_runs(args.wandb, ids, args.wandb_timeout)
    _unique_names(summaries)
    print(format_table(summaries))
    common = common_tokens(summaries)
    if common is not None:
        print(f"(loss @{common:,} tok: each run's loss at the last logged step within the first {common:,} tokens "
              "it trained, the most all compared runs reached; speeds are medians after step 1)")
    scores = format_eval_table(summaries)
    if scores:
        print("\neval scores (RUN_DIR/eval/results.json): NIAH answer found %, mean over depths; RULER average\n"
              + scores)
    written = [plot(summaries, args.plot), plot_throughput(summaries, throughput)]
    if args.csv:
        written.append(write_csv(summaries, args.csv))
    if args.markdown:
        written.append(write_markdown(summaries, args.markdown))
    print("\n" + "\n".join(f"wrote {path}" for path in written))
    return 0
