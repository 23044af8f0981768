"""Models from the Hugging Face hub: `model.path: org/name[@revision]` fetched into the model cache.

A `model.path` that is not on disk and reads as `org/name` (optionally `@revision`) is a hub id.
The job (or `offload-jobs pull`) fetches it with huggingface_hub into the worker's model cache
(`jobs.home.model_cache`: /models in the container, the state dir's `models/` locally), only the
parts a diffusers pipeline loads: `model_index.json` and the folders it names (transformer, VAE,
text encoders, tokenizers, scheduler), never the single-file checkpoints a repo also carries.

The token comes from the worker's environment (`HF_TOKEN`) or a file (`OFFLOAD_JOBS_HF_TOKEN_FILE`,
a Docker secret say); it is handed to huggingface_hub and never printed. Offline (`HF_HUB_OFFLINE=1`,
or no network) the cache is used, or the error says what is missing.

Stdlib at import; huggingface_hub is imported only when something is fetched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jobs.contract import Reason
from jobs.errors import chain

__all__ = ["HubRef", "HubError", "parse_hub_id", "hub_token", "fetch_model", "plan_fetch", "FetchPlan",
           "TOKEN_ENV", "TOKEN_FILE_ENV"]

TOKEN_ENV = "HF_TOKEN"
TOKEN_FILE_ENV = "OFFLOAD_JOBS_HF_TOKEN_FILE"
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<rev>[\w./-]{1,200}))?")
# Weight formats a diffusers folder may carry beside its safetensors; the loaders here read safetensors.
_IGNORE = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.msgpack", "*.h5", "*.onnx", "*.onnx_data", "*.gguf", "*.md",
           "*.png", "*.jpg"]


class HubError(Exception):
    """A hub model that cannot be had: gated without a token, not found, offline and not cached."""

    reason = Reason.SETUP_FAILED


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str = "main"

    def __str__(self) -> str:
        return self.repo if self.revision == "main" else f"{self.repo}@{self.revision}"


def parse_hub_id(value: str | None, base: str | os.PathLike[str] | None = None) -> HubRef | None:
    """The hub id `value` names, or None when it is a local path (one that exists, or looks like a path)."""
    if not value or value.startswith(("/", ".", "~")) or "\\" in value:
        return None
    local = Path(base, value) if base is not None else Path(value)
    if local.exists():
        return None
    m = _HUB_ID.fullmatch(value)
    if m is None or m["repo"].endswith((".safetensors", ".json")) or ".." in value:
        return None
    return HubRef(m["repo"], m["rev"] or "main")


def hub_token() -> str | None:
    """The worker's hub token: $HF_TOKEN, else the file $OFFLOAD_JOBS_HF_TOKEN_FILE names."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    if path:
        try:
            return Path(path).expanduser().read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise HubError(f"{TOKEN_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
    return None


def _needed(index: dict[str, Any], configs_only: tuple[str, ...] = ()) -> list[str]:
    """allow_patterns: model_index.json and every component folder it names (a null entry is absent);
    of the parts in `configs_only` (a transformer given as its own file) only their config.json."""
    parts = sorted(k for k, v in index.items()
                   if not k.startswith("_") and isinstance(v, list) and v and v[0] is not None)
    return ["model_index.json", *(f"{p}/config.json" if p in configs_only else f"{p}/*" for p in parts)]


@dataclass
class FetchPlan:
    ref: HubRef
    commit: str
    files: list[tuple[str, int, bool]] = field(default_factory=list)  # (name, bytes, cached)
    patterns: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.files)

    @property
    def to_fetch(self) -> int:
        return sum(size for _, size, cached in self.files if not cached)


def _explain(exc: BaseException, ref: HubRef, cache: Path) -> HubError:
    """One line for what huggingface_hub raised, naming the token variable or what is missing."""
    from huggingface_hub import errors as hf

    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, hf.GatedRepoError) or status in (401, 403):
        has = bool(os.environ.get(TOKEN_ENV, "").strip() or os.environ.get(TOKEN_FILE_ENV, "").strip())
        how = ("the worker's token has no access to it: accept its licence on the hub with that account"
               if has else f"set {TOKEN_ENV} in the worker's environment (or {TOKEN_FILE_ENV} to a file holding it)")
        return HubError(f"model.path: {ref.repo} is gated or private on the hub (HTTP {status or 401}); {how}")
    if isinstance(exc, hf.RevisionNotFoundError):
        return HubError(f"model.path: {ref.repo} has no revision {ref.revision!r} on the hub")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return HubError(f"model.path: {ref.repo} is neither a folder on the worker nor a model on the hub")
    if _unreachable(exc):
        return HubError(f"model.path: {ref} is not complete in the model cache and the hub cannot be reached "
                        f"({os.environ.get('HF_ENDPOINT') or 'huggingface.co'}): {_missing(ref, cache)}; "
                        f"run `offload-jobs pull {ref}` where the hub can be reached")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return HubError(f"model.path: fetching {ref} from the hub failed: {first[:300]}")


_UNREACHABLE = {"HubUnreachable", "ConnectError", "ConnectTimeout", "TimeoutException", "ReadTimeout", "NetworkError",
                "LocalEntryNotFoundError", "DryRunError", "OfflineModeIsEnabled"}


def _unreachable(exc: BaseException | None) -> bool:
    """The hub could not be asked (no network, a proxy, offline mode): somewhere in the exception chain."""
    return any(c.__name__ in _UNREACHABLE for e in chain(exc, limit=8) for c in type(e).__mro__)


class HubUnreachable(ConnectionError):
    """The hub's host refused or did not answer one quick connection (no network, nothing listening)."""


def _probe_endpoint(timeout: float = 3.0) -> None:
    """One TCP connection to the hub's host, no retries: huggingface_hub retries a refused or timed-out
    request five times with backoff (about 23 s) before a box without network can use its cache.
    Skipped behind a proxy, where the proxy is what answers."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return
    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    if not url.hostname:
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise HubUnreachable(f"{constants.ENDPOINT}: {exc}") from exc


def _missing(ref: HubRef, cache: Path) -> str:
    """What the cache lacks for `ref` (offline): no snapshot at all, or the files of the one it has."""
    try:
        _cached_snapshot(ref, cache)
    except HubError as exc:
        return str(exc)
    return "nothing"


def _cached_snapshot(ref: HubRef, cache: Path, configs_only: tuple[str, ...] = ()) -> Path:
    """The cached snapshot of `ref` with every file a pipeline loads, found without the network.

    Raises HubError saying what is missing: the snapshot, model_index.json, component folders, or
    the files the hub's tree listing (cached at fetch time) names that are not there."""
    storage = cache / f"models--{ref.repo.replace('/', '--')}"
    ref_file = storage / "refs" / ref.revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else ref.revision
    snap = storage / "snapshots" / commit
    if not snap.is_dir():
        raise HubError(f"no snapshot of {ref} in {cache}")
    try:
        patterns = _needed(json.loads((snap / "model_index.json").read_text(encoding="utf-8")), configs_only)
    except (OSError, ValueError):
        raise HubError(f"{snap} has no readable model_index.json") from None
    absent = [p.removesuffix("/*") for p in patterns[1:] if not (snap / p.removesuffix("/*")).exists()]
    try:
        listed = json.loads((storage / "trees" / f"{commit}.json").read_text(encoding="utf-8")).get("files") or {}
    except (OSError, ValueError, AttributeError):
        listed = {}
    if listed:
        from huggingface_hub.utils import filter_repo_objects

        wanted = filter_repo_objects(list(listed), allow_patterns=patterns, ignore_patterns=_IGNORE)
        absent += [f for f in wanted if not (snap / f).exists() and f.split("/")[0] not in absent]
    if absent:
        more = f" and {len(absent) - 8} more" if len(absent) > 8 else ""
        raise HubError(f"{snap} lacks {', '.join(absent[:8])}{more}")
    return snap


def _index(ref: HubRef, cache: Path, token: str | None) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(ref.repo, "model_index.json", revision=ref.revision, cache_dir=str(cache), token=token)
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise HubError(f"model.path: {ref}'s model_index.json is not JSON ({exc}); a diffusers repo is expected") from None


def plan_fetch(ref: HubRef, cache: Path, configs_only: tuple[str, ...] = ()) -> FetchPlan:
    """Which files `ref` needs, their sizes and which are cached already (asks the hub; fetches only model_index.json)."""
    from huggingface_hub import snapshot_download

    token = hub_token()
    try:
        _probe_endpoint()
        patterns = _needed(_index(ref, cache, token), configs_only)
        infos = snapshot_download(ref.repo, revision=ref.revision, cache_dir=str(cache), token=token,
                                  allow_patterns=patterns, ignore_patterns=_IGNORE, dry_run=True, tqdm_class=_Progress)
    except HubError:
        raise
    except Exception as exc:
        if _unreachable(exc):
            raise  # the caller may use the cache
        raise _explain(exc, ref, cache) from None
    plan = FetchPlan(ref, infos[0].commit_hash if infos else ref.revision, patterns=patterns)
    plan.files = sorted((i.filename, int(i.file_size or 0), bool(i.is_cached)) for i in infos)
    return plan


class _Progress:
    """A tqdm stand-in for huggingface_hub: a line every few seconds (and at the end) through `say`."""

    say: Callable[[str], None] = staticmethod(lambda line: None)
    every = 5.0

    def __init__(self, *args: Any, total: float | None = None, initial: float = 0, desc: str = "", **kw: Any) -> None:
        self.total, self.n, self.desc = total, initial or 0, desc or ""
        self._last = time.monotonic()

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0
        if "bytes" in self.desc.lower() and time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            total = f" of {self.total / 1e6:.1f} MB" if self.total else ""
            type(self).say(f"downloaded {self.n / 1e6:.1f} MB{total}")

    def __getattr__(self, name: str) -> Any:  # refresh, set_description, set_postfix_str, ...
        return lambda *a, **k: None

    def close(self) -> None:
        pass


def fetch_model(ref: HubRef, cache: Path, *, say: Callable[[str], None] = print,
                event: Callable[..., None] | None = None, configs_only: tuple[str, ...] = ()) -> Path:
    """The local snapshot folder of `ref`, fetched into `cache` (only the files a pipeline loads; of
    the parts in `configs_only`, only their config.json).

    `say(line)` gets progress lines (the job's log), `event(type, **data)` a start and an end record.
    Raises HubError with one line when the model cannot be had."""
    from huggingface_hub import snapshot_download

    cache.mkdir(parents=True, exist_ok=True)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    token = hub_token()
    t0 = time.monotonic()
    try:
        if offline:
            try:
                folder = _cached_snapshot(ref, cache, configs_only)
            except HubError as exc:
                raise HubError(f"model.path: {ref} is not complete in the model cache and HF_HUB_OFFLINE=1: {exc}; "
                               f"run `offload-jobs pull {ref}` where the hub can be reached") from None
            say(f"model {ref}: using the cached snapshot {folder} (HF_HUB_OFFLINE=1)")
            return folder
        plan = plan_fetch(ref, cache, configs_only)
        free = shutil.disk_usage(cache).free
        if plan.to_fetch > free:
            raise HubError(f"model.path: {ref} needs {plan.to_fetch / 1e9:.2f} GB more in {cache}, "
                           f"which has {free / 1e9:.2f} GB free")
        start = {"model": str(ref), "commit": plan.commit, "files": len(plan.files),
                 "bytes": plan.total_bytes, "to_fetch": plan.to_fetch, "cache": str(cache)}
        if event is not None:
            event("model_fetch", **start)
        say(f"model {ref}: {len(plan.files)} files, {plan.total_bytes / 1e6:.1f} MB "
            f"({plan.to_fetch / 1e6:.1f} MB to fetch) into {cache}")
        _Progress.say = staticmethod(say)
        folder = snapshot_download(ref.repo, revision=plan.commit, cache_dir=str(cache), token=token,
                                   allow_patterns=plan.patterns, ignore_patterns=_IGNORE, tqdm_class=_Progress)
        # `main` (or the tag) keeps pointing at the commit fetched, for offline use later
        refs = cache / f"models--{ref.repo.replace('/', '--')}" / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        if not (refs / ref.revision).is_file() or (refs / ref.revision).read_text().strip() != plan.commit:
            (refs / ref.revision).write_text(plan.commit)
    except HubError:
        raise
    except Exception as exc:
        if _unreachable(exc):  # no network: the cache, if it holds the whole model
            try:
                folder = _cached_snapshot(ref, cache, configs_only)
            except HubError:
                raise _explain(exc, ref, cache) from None
            say(f"model {ref}: the hub cannot be reached; using the cached snapshot {folder}")
            return folder
        raise _explain(exc, ref, cache) from None
    seconds = time.monotonic() - t0
    if event is not None:
        event("model_ready", model=str(ref), path=str(folder), fetched_bytes=plan.to_fetch, seconds=round(seconds, 2))
    say(f"model {ref}: ready at {folder} ({plan.to_fetch / 1e6:.1f} MB fetched in {seconds:.1f} s)")
    return Path(folder)


def resolve_model_path(value: str | None, run_dir: str | os.PathLike[str] | None = None,
                       configs_only: tuple[str, ...] = ()) -> str | None:
    """In a job: `model.path` as a local folder, a hub id fetched first into the worker's model cache
    (of the parts in `configs_only`, only their config.json: a `model.base` whose transformer is a file).

    The run dir (`<state>/runs/<id>`) names the state dir whose cache is used, and gets the events."""
    ref = parse_hub_id(value)
    if ref is None:
        if value:
            _check_readable(Path(value).expanduser())
        return value
    from jobs.home import model_cache, state_home

    run = Path(run_dir) if run_dir else None
    home = run.parent.parent if run is not None else state_home()

    def event(type: str, **data: Any) -> None:
        from jobs.runners.telemetry import emit_event

        emit_event(run, type, **data)

    folder = fetch_model(ref, model_cache(home), say=lambda line: print(f"[offload-jobs] {line}", flush=True),
                         event=event, configs_only=configs_only)
    _check_readable(folder)
    return str(folder)


def _check_readable(folder: Path) -> None:
    """PermissionError naming the first file of the model this process cannot read (a 0600 file of
    another uid, in a container): found here rather than as a FileNotFoundError deep in a loader."""
    if not folder.is_dir():
        return
    for path in sorted(folder.rglob("*")):
        kind = os.R_OK | (os.X_OK if path.is_dir() else 0)
        if not os.access(path, kind):
            import errno

            raise PermissionError(errno.EACCES, "Permission denied", str(path))
