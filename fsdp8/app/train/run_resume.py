"""Which checkpoint ``fsdp8 train --resume`` continues from, decided in the launching process:
the newest one that can be loaded (a damaged or interrupted newer one is passed over, saying
so), the settings it remembers, and the data file it trained on, checked to be the same."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Collection, List, Optional, Tuple

from ...checkpoint.store import METADATA, MARKER, complete_checkpoints, extra_path
from ...checkpoint.verify import verify
from ...data import file_fingerprint
from .config import TrainConfig
from .run_log import run_dir_of

# Settings a resumed run takes from its checkpoint unless they are given again; never these.
PER_INVOCATION = {"out", "resume", "overwrite", "stop_at", "data"}
PARTIAL = ".partial"
_STEP_NAME = re.compile(r"^step-(\d+)(\.partial)?$")


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from, its saved extra values, and the lines to print."""

    checkpoint: str
    extra: dict
    notes: Tuple[str, ...]


def _is_checkpoint(path: str) -> bool:
    """Whether ``path`` is one checkpoint (complete or not), rather than a folder of them."""
    if path.rstrip("/").endswith(PARTIAL) or _STEP_NAME.match(os.path.basename(os.path.normpath(path))):
        return True
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name)) for name in (METADATA, MARKER, extra_path("", 0)))


def run_dir_named(resume: str) -> Optional[str]:
    """The run directory ``--resume DIR`` names (its outputs go there), decided from the path
    alone: a run directory, its checkpoints/ folder, or a checkpoint in it."""
    if _is_checkpoint(resume):
        return run_dir_of(resume)
    if os.path.isdir(os.path.join(resume, "checkpoints")):
        return resume
    if os.path.basename(os.path.normpath(resume)) == "checkpoints":
        return os.path.dirname(os.path.normpath(resume)) or "."
    return None


def _candidates(folder: str) -> List[str]:
    """The checkpoints in ``folder``, newest first: fsdp8 train's ``step-N`` (with any
    interrupted ``step-N.partial`` that has no complete namesake) by step, else the complete
    ones by the order of their markers."""
    steps = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _STEP_NAME.match(name)
        path = os.path.join(folder, name)
        if match and os.path.isdir(path) and not (match.group(2) and os.path.isdir(path[:-len(PARTIAL)])):
            steps.append((int(match.group(1)), path))
    if steps:
        return [path for _, path in sorted(steps, reverse=True)]
    return complete_checkpoints(folder)[::-1]


def saved_extra(checkpoint: str) -> dict:
    """Rank 0's extra values of an fsdp8 checkpoint: its step, the run's settings and data."""
    path = extra_path(checkpoint, 0)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            extra = json.load(f)
        if not (isinstance(extra, dict) and isinstance(extra.get("config", {}), dict)
                and type(extra.get("step", 0)) is int):
            raise ValueError("not an object with a config object and an integer step")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from None
    return extra


def _problems(checkpoint: str) -> List[str]:
    """What keeps ``checkpoint`` from being resumed, as sentences (empty when nothing does)."""
    if checkpoint.endswith(PARTIAL):
        return ["a save that was interrupted (the run was killed while writing it), which cannot be loaded"]
    found = verify(checkpoint)
    if not found:
        try:
            saved_extra(checkpoint)
        except ValueError as e:
            found.append(str(e))
    return found


def _named(passed: List[Tuple[str, List[str]]]) -> str:
    return "; ".join(f"{os.path.basename(path)} ({'; '.join(wrong)})" for path, wrong in passed)


def _check_named(folder: str, checkpoint: str, fresh: str) -> str:
    """``checkpoint``, the one the user named, if it can be resumed; else a ValueError that
    names the newest one beside it that can."""
    wrong = _problems(checkpoint)
    if not wrong:
        return checkpoint
    intact = next((c for c in _candidates(folder) if c != checkpoint and not _problems(c)), None)
    instead = (f"the newest checkpoint beside it that can be loaded is {intact}: pass --resume {intact}" if intact
               else f"no checkpoint beside it can be loaded either; {fresh}")
    raise ValueError(f"--resume: cannot continue from {checkpoint}: {'; '.join(wrong)}; {instead}")


def _newest(folder: str, fresh: str) -> Tuple[str, List[str]]:
    """The newest checkpoint of ``folder`` that can be resumed, and the line to print when newer
    ones were passed over. Raises, naming every checkpoint tried, when none can be resumed."""
    passed: List[Tuple[str, List[str]]] = []
    for candidate in _candidates(folder):
        wrong = _problems(candidate)
        if not wrong:
            notes = [f"--resume: passed over {_named(passed)} in {folder}; resuming from "
                     f"{os.path.basename(candidate)}, the newest checkpoint that can be loaded"] if passed else []
            return candidate, notes
        passed.append((candidate, wrong))
    if passed and all(path.endswith(PARTIAL) for path, _ in passed):
        names = ", ".join(os.path.basename(path) for path, _ in passed)
        raise ValueError(f"--resume: {folder} holds no complete checkpoint, only {names}: a save that was "
                         f"interrupted (the run was killed while writing it), which cannot be loaded; {fresh} "
                         "(deleting it)")
    if passed:
        raise ValueError(f"--resume: no checkpoint in {folder} can be loaded: {_named(passed)}; restore "
                         f"their files, or {fresh}")
    raise FileNotFoundError(f"--resume: {folder} holds no checkpoint to continue from (a run writes them with "
                            f"--save-every N or --stop-at N); {fresh}")


def choose_checkpoint(resume: str, fresh: str) -> Resume:
    """The checkpoint ``--resume DIR`` continues from (see the module docstring); ``fresh`` says
    how to start afresh instead, for the errors."""
    if not os.path.exists(resume):
        raise FileNotFoundError(f"--resume: {resume}: no such directory; give a run directory (with checkpoints/), "
                                "its checkpoints/ folder or one checkpoint")
    if _is_checkpoint(resume):
        path = os.path.normpath(resume)
        path, notes = _check_named(os.path.dirname(path), path, fresh), []
    else:
        folder = os.path.join(resume, "checkpoints")
        path, notes = _newest(folder if os.path.isdir(folder) else resume, fresh)
    return Resume(path, saved_extra(path), tuple(notes))


def _data(cfg: TrainConfig, given: Collection[str], resume: Resume) -> Tuple[str, List[str]]:
    """The data file a resumed run trains on: ``--data`` when given again, else the run's own
    when it is still there unchanged (its size and SHA-256, recorded by the run, agree)."""
    was = resume.extra.get("config", {}).get("data", "")
    recorded = resume.extra.get("data")
    if "data" in given:
        if was and isinstance(recorded, dict) and cfg.data and os.path.isfile(cfg.data):
            if file_fingerprint(cfg.data) != {k: recorded.get(k) for k in ("bytes", "sha256")}:
                return cfg.data, [f"--resume: training on --data {cfg.data} as asked; the run trained on {was} until "
                                  "now, whose content differs"]
        return cfg.data, []
    if not was:
        return "", []
    again = f"pass --data FILE to say what to train on (--data {was} if it is right)"
    if not isinstance(was, str) or not isinstance(recorded, dict):
        raise ValueError(f"--resume: {resume.checkpoint} does not record what its data file {was!r} held, so it "
                         f"cannot be checked; {again}")
    if not os.path.isfile(was):
        raise ValueError(f"--resume: the run trained on --data {was}, which is no longer there; {again}")
    now = file_fingerprint(was)
    if now != {k: recorded.get(k) for k in ("bytes", "sha256")}:
        raise ValueError(f"--resume: the run trained on --data {was}, which has changed since ({recorded.get('bytes')} "
                         f"bytes then, {now['bytes']} now, other content); {again}")
    return was, []


def resumed_config(cfg: TrainConfig, given: Collection[str], resume: Resume) -> Tuple[TrainConfig, List[str]]:
    """``cfg`` continuing ``resume``: the settings not ``given`` come from the checkpoint, the
    data as ``_data`` decides; with the lines to print. Raises ValueError for what cannot work."""
    checkpoint, saved = resume.checkpoint, resume.extra.get("config", {})
    if "preset" in saved and {"model", "preset"} & set(given):
        was = saved.get("model", "")
        if was != cfg.model or (not was and saved["preset"] != cfg.preset):
            held = was or f"the {saved['preset']!r} preset"
            again = f"--model {was}" if was else f"--preset {saved['preset']}"
            raise ValueError(f"--resume: {checkpoint} holds {held}, not {cfg.model or repr(cfg.preset)}; drop "
                             f"--model and --preset or pass {again}")
    settings = cfg.settings()
    # The saved settings are TrainConfig.settings() (flag names), as every fsdp8 train has saved them.
    remembered = {k: v for k, v in saved.items() if k in set(settings) - PER_INVOCATION - set(given)}
    if "tp" in given and cfg.parallel.tp == 1:  # a layout without tensor parallelism: the switches of tp go with it
        for name in ("sequence_parallel", "loss_parallel"):
            remembered.pop(name, None)
    data, notes = _data(cfg, given, resume)
    try:
        cfg = TrainConfig.from_settings(dict(settings, resume=checkpoint, data=data, **remembered))
    except TypeError as e:
        raise ValueError(f"--resume: the settings saved in {extra_path(checkpoint, 0)} are not valid ({e})") from None
    step = resume.extra.get("step", 0)
    if cfg.steps <= step:
        raise ValueError(f"--resume: {checkpoint} is at step {step} already; pass --steps above {step} to go on")
    return cfg, list(resume.notes) + notes
