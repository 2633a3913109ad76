"""Hugging Face hub ids as inputs: `org/name[@revision]` -> a commit sha (at plan time) -> a
local snapshot folder (when a stage runs), through huggingface_hub and its cache.

Input: a value as written (`Qwen/Qwen2.5-0.5B-Instruct`, `org/name@v1.0`, `org/name@<sha>`) and
the environment huggingface_hub reads, read here at each call: `HF_HUB_CACHE` (else
`HF_HOME/hub`), `HF_HUB_OFFLINE`, `HF_ENDPOINT`, and a token from `HF_TOKEN` or the login file
(left to huggingface_hub: never read into a value pipe keeps, logs or writes).
Output: `HubId` (`parse`); `pin` -> a `Pin` (the commit sha and where it was read), or a
`HubError` whose one-line message says what to do (offline, a model the cache holds in part
too); `fetch` -> the snapshot folder, complete (`engine.hub_files`), downloaded or completed
at most once per node at a time (a file lock in the cache).

Light: the local cache is read as files (`refs/<revision>`, `snapshots/<sha>`); huggingface_hub
is imported only to ask the hub (`pin` with the network) or to download (`fetch`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.hub_files import missing

DEFAULT_ENDPOINT = "https://huggingface.co"
PIN_TIMEOUT_S = 10.0  # how long `pipe plan` waits for the hub to name a revision's commit
SHA = re.compile(r"^[0-9a-f]{40}$")
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(Exception):
    """A hub id that cannot be pinned or fetched; the message says why and what to do
    (`unknown`: the hub knows no such repository)."""

    def __init__(self, message: str, unknown: bool = False) -> None:
        super().__init__(message)
        self.unknown = unknown


@dataclass(frozen=True)
class HubId:
    """A repository on the hub and the revision asked for (`main` when none is written)."""

    repo: str
    revision: str = "main"
    written: str = ""

    @property
    def pinned(self) -> bool:
        return bool(SHA.match(self.revision))

    def at(self, sha: str) -> str:
        """The id pinned: `org/name@<sha>`."""
        return f"{self.repo}@{sha}"


@dataclass(frozen=True)
class Pin:
    """A revision's commit and where it was read."""

    sha: str
    source: str  # "the local cache" | "the hub (<endpoint>)" | "as written"


def parse(value: str) -> HubId | None:
    """The hub id `value` names, or None when it cannot be one (a path, a URL, `@stage`)."""
    if value.startswith(("/", ".", "@", "~")) or "://" in value:
        return None
    if value.lower().endswith((".gguf", ".jinja", ".j2")):  # a file (`model:`, `chat_template:`)
        return None
    m = HUB_ID.match(value)
    if m is None:
        return None
    return HubId(m["repo"], m["revision"] or "main", value)


@dataclass(frozen=True)
class HubField:
    """One of a config's `hub_inputs` as found: its value (one, or a list) and the hub ids in
    it, each with its index in the list (0 for a single value)."""

    dotted: str
    repo_type: str  # the repository type, as huggingface_hub names it: model or dataset
    value: Any
    ids: tuple[tuple[int, str, HubId], ...]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.dotted.split("."))

    @property
    def many(self) -> bool:
        return isinstance(self.value, list)

    @property
    def values(self) -> list[Any]:
        return list(self.value) if self.many else [self.value]

    def rebuilt(self, values: list[Any]) -> Any:
        """`values` in the field's shape: the list, or its one value."""
        return values if self.many else values[0]


def hub_fields(
    hub_inputs: Mapping[str, str], get: Callable[[tuple[str, ...]], Any]
) -> Iterator[HubField]:
    """The walk over a config's hub ids: each `hub_inputs` field (`{dotted: repo type}`, the
    kind's hook), its value read by `get(path)` when the walk reaches it (the plan reads
    merged data, a run the frozen config), and the hub ids it holds."""
    for dotted, repo_type in hub_inputs.items():
        value = get(tuple(dotted.split(".")))
        values = value if isinstance(value, list) else [value]
        ids = tuple(
            (i, v, hub)
            for i, v in enumerate(values)
            if isinstance(v, str) and (hub := parse(v)) is not None
        )
        yield HubField(dotted, repo_type, value, ids)


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").upper() in _TRUE


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_cache() -> str:
    """The cache folder huggingface_hub uses with this environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return os.path.join(os.path.expanduser(home), "hub")


def repo_folder(repo: str, repo_type: str = "model") -> str:
    """The repository's folder in the cache (`models--org--name`)."""
    return os.path.join(hub_cache(), "--".join([f"{repo_type}s", *repo.split("/")]))


def cached_sha(hub: HubId, repo_type: str = "model") -> str | None:
    """The commit the local cache holds for the revision (its `refs/` file, or the sha itself),
    when its snapshot folder is there; None otherwise."""
    folder = repo_folder(hub.repo, repo_type)
    sha = hub.revision if hub.pinned else None
    if sha is None:
        ref = os.path.join(folder, "refs", hub.revision)
        with contextlib.suppress(OSError), open(ref, encoding="utf-8") as f:
            sha = f.read().strip()
    if sha and os.path.isdir(os.path.join(folder, "snapshots", sha)):
        return sha
    return None


def cached_file(value: str, name: str, repo_type: str = "model") -> str | None:
    """`name` in the cached snapshot of the hub id `value`, when the cache holds it."""
    hub = parse(value)
    sha = cached_sha(hub, repo_type) if hub is not None else None
    if hub is None or sha is None:
        return None
    path = os.path.join(repo_folder(hub.repo, repo_type), "snapshots", sha, name)
    return path if os.path.isfile(path) else None


def download_command(hub: HubId, repo_type: str = "model") -> str:
    rev = "" if hub.revision == "main" else f" --revision {hub.revision}"
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    return f"hf download {hub.repo}{rev}{kind}"


def not_cached(hub: HubId, repo_type: str = "model") -> str:
    return (
        f"'{hub.written or hub.repo}' is not in the Hugging Face cache ({hub_cache()}) and "
        f"HF_HUB_OFFLINE is set: download it where there is a network (`"
        f"{download_command(hub, repo_type)}` with the same HF_HOME or HF_HUB_CACHE), or unset "
        "HF_HUB_OFFLINE so that pipe plan asks the hub"
    )


def incomplete(hub: HubId, repo_type: str, lacks: list[str]) -> str:
    return (
        f"'{hub.written or hub.repo}' is in the Hugging Face cache ({hub_cache()}) without "
        f"{', '.join(lacks)} (a download of some of its files, or of its tokenizer alone), and "
        f"HF_HUB_OFFLINE is set: complete it where there is a network (`"
        f"{download_command(hub, repo_type)}` with the same HF_HOME or HF_HUB_CACHE), or unset "
        "HF_HUB_OFFLINE so that the run downloads what is missing"
    )


def snapshot_lacks(hub: HubId, sha: str, repo_type: str = "model") -> list[str]:
    """What the cached snapshot of a model at `sha` lacks to load (`engine.hub_files`): its
    config, weights, indexed shards or tokenizer; a dataset's snapshot is taken as it is."""
    if repo_type != "model":
        return []
    return missing(os.path.join(repo_folder(hub.repo, repo_type), "snapshots", sha))


def pin(
    hub: HubId, repo_type: str = "model", network: bool = True, timeout_s: float = PIN_TIMEOUT_S
) -> Pin | None:
    """The commit `hub`'s revision names: a sha as written; offline (`HF_HUB_OFFLINE`), the
    local cache's; else the hub's (asked with `timeout_s`), or with `network` off (`pipe
    validate`) the cache's when it has one and None when it has none."""
    if offline():
        sha = cached_sha(hub, repo_type)
        if sha is None:
            raise HubError(not_cached(hub, repo_type))
        lacks = snapshot_lacks(hub, sha, repo_type)
        if lacks:
            raise HubError(incomplete(hub, repo_type, lacks))
        return Pin(sha, "as written" if hub.pinned else "the local cache")
    if hub.pinned:
        return Pin(hub.revision, "as written")
    if not network:
        sha = cached_sha(hub, repo_type)
        return Pin(sha, "the local cache") if sha else None
    sha = _ask_hub(hub, repo_type, timeout_s)
    _remember(hub, repo_type, sha)
    return Pin(sha, f"the hub ({endpoint()})")


def _remember(hub: HubId, repo_type: str, sha: str) -> None:
    """Write the revision's commit into the cache's `refs/` as huggingface_hub does when it
    learns one, so that an offline plan after the run's download pins the same commit."""
    ref = os.path.join(repo_folder(hub.repo, repo_type), "refs", hub.revision)
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(ref), exist_ok=True)
        with open(ref, "w", encoding="utf-8") as f:
            f.write(sha)


def _ask_hub(hub: HubId, repo_type: str, timeout_s: float) -> str:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = endpoint()
    try:
        info = HfApi(endpoint=where).repo_info(
            hub.repo, repo_type=repo_type, revision=hub.revision, timeout=timeout_s
        )
    except GatedRepoError:
        raise HubError(
            f"'{hub.repo}' is gated: accept its terms on {where}/{_page(hub.repo, repo_type)} "
            "with your account, then set HF_TOKEN to a token of that account (or run "
            "`hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise HubError(
            f"the hub ({where}) has no revision '{hub.revision}' of '{hub.repo}': name a branch, "
            "a tag or a commit of it"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"the hub ({where}) knows no {repo_type} '{hub.repo}', or it is private and no token "
            "of an account that can read it was sent: check the id (org/name, as on its page); "
            "for a private one set HF_TOKEN (or run `hf auth login`)",
            unknown=True,
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        raise HubError(
            f"the hub ({where}) answered {status} for '{hub.repo}'@{hub.revision}: try again, or "
            f"use the local cache (`{download_command(hub, repo_type)}`, then HF_HUB_OFFLINE=1)"
        ) from None
    except Exception as exc:  # the HTTP client's (httpx) connection errors and timeouts
        if not _unreachable(exc):
            raise
        raise HubError(
            f"the hub ({where}) could not be reached in {timeout_s:g} s ({type(exc).__name__}): "
            f"without a network here, fill the cache where there is one (`"
            f"{download_command(hub, repo_type)}`, with the same HF_HOME or HF_HUB_CACHE) and set "
            "HF_HUB_OFFLINE=1 so that pipe reads the cache"
        ) from None
    if not info.sha:
        raise HubError(f"the hub ({where}) named no commit for '{hub.repo}'@{hub.revision}")
    return str(info.sha)


def _unreachable(exc: BaseException) -> bool:
    """A connection refused, reset or timed out (the HTTP client's own error classes, whatever
    its version names them), or an OS-level network error."""
    names = {c.__name__ for c in type(exc).__mro__}
    return isinstance(exc, OSError | TimeoutError) or bool(
        names & {"TimeoutException", "NetworkError", "TransportError", "ConnectError"}
    )


def _page(repo: str, repo_type: str) -> str:
    return repo if repo_type == "model" else f"{repo_type}s/{repo}"


@contextlib.contextmanager
def _locked(path: str, shared: bool = False) -> Iterator[None]:
    """A lock on `path` (made if missing) for as long as the block runs: exclusive, the ranks,
    engines and workers of a node (or of nodes sharing the cache) take turns to download;
    `shared`, readers wait for a download under way and not for each other (a cache they
    cannot write, read-only storage, is read without one)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError:
        if not shared:
            raise
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(value: str, log: logging.Logger | None = None, repo_type: str = "model") -> str:
    """The local snapshot folder of the pinned hub id `value` (`org/name@<sha>`): from the cache
    when it is complete there (a model's config, weights, every indexed shard and tokenizer:
    `engine.hub_files`), else downloaded, or completed, by one process of the node while the
    others wait on the lock (huggingface_hub's progress bar, and a line in `log` before and
    after). A download under way holds the lock: no reader takes its folder half filled."""
    hub = parse(value)
    if hub is None:
        raise HubError(f"'{value}' is not a hub id (org/name@revision)")
    name = os.path.basename(repo_folder(hub.repo, repo_type))
    lock = os.path.join(hub_cache(), ".locks", f"pipe-{name}.lock")
    with _locked(lock, shared=True):
        folder, lacks = _cached(hub, repo_type)
    if folder is not None and not lacks:
        return folder
    if offline():
        raise HubError(
            not_cached(hub, repo_type) if folder is None else incomplete(hub, repo_type, lacks)
        )
    with _locked(lock):
        folder, lacks = _cached(hub, repo_type)  # another process got it meanwhile
        if folder is not None and not lacks:
            return folder
        if log is not None:
            why = f" (the cache lacks {', '.join(lacks)})" if lacks else ""
            log.info("downloading %s%s from %s into %s", value, why, endpoint(), hub_cache())
        start = time.monotonic()
        folder = _snapshot(hub, repo_type, local=False)
        if log is not None:
            log.info("downloaded %s in %.1f s: %s", value, time.monotonic() - start, folder)
        return folder


def _cached(hub: HubId, repo_type: str) -> tuple[str | None, list[str]]:
    """The cache's snapshot folder of `hub` (None when it has none) and what it lacks."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = _snapshot(hub, repo_type, local=True)
    except LocalEntryNotFoundError:
        return None, []
    sha = os.path.basename(os.path.normpath(folder))
    return folder, snapshot_lacks(hub, sha, repo_type)


def _snapshot(hub: HubId, repo_type: str, local: bool) -> str:
    """The snapshot folder, read from the cache (`local`) or downloaded with a progress bar of
    the bytes: plain tqdm's, which `HF_HUB_DISABLE_PROGRESS_BARS` (set on every worker, so that
    transformers' loading bars stay out of the run's output) does not silence."""
    from huggingface_hub import snapshot_download

    bars: dict[str, Any] = {}
    if not local:
        from tqdm import tqdm

        bars["tqdm_class"] = tqdm
    folder = snapshot_download(
        hub.repo,
        repo_type=repo_type,
        revision=hub.revision,
        cache_dir=hub_cache(),
        endpoint=endpoint(),
        local_files_only=local,
        **bars,
    )
    return str(folder)
