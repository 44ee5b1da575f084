"""The suite on pytest-xdist workers (``make test``: ``-n 2 --dist loadgroup``): which tests
must share a worker, and a scheduler that keeps each such group on one worker.

A group runs on one worker, its tests one after another; a test of no group goes to whichever
worker is free. Grouped are

* every test of a module that starts vLLM engines, in one group: two engines at once would share
  the machine's cores and memory (and many of these modules already start several in parallel);
* the users of a session fixture of this project, in one group per conftest: set up once;
* the tests of a module that use one of its module- or class-scoped fixtures (a server, a model,
  a Mooncake master): started once, not once per worker.

xdist's own ``loadgroup`` takes its groups from ``xdist_group`` marks by appending ``@group`` to
the test ids; with pytest 9.2's structured ids that append is lost and the marks are silently
ignored (pytest-dev/pytest-xdist#1386). So the groups travel in a file instead: each worker
writes the groups of what it collected, and the scheduler (on the controller, which collects
nothing itself) reads them before it hands out the first test.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

#: the key, in each worker's ``workerinput``, of the directory the groups are written to
GROUPS_DIR = "kvtier_groups_dir"
#: modules that start vLLM engines (all in :data:`VLLM_GROUP`)
VLLM_ENGINE_MODULES = ("tests/integrations/vllm/", "tests/bench/test_bench_vllm.py",
                       "tests/bench/test_bench_route_trace.py")
VLLM_GROUP = "vllm-engines"
#: where the controller keeps that directory
_groups_dir_key = pytest.StashKey[Path]()


def group_of(item: pytest.Item) -> str | None:
    """The group of ``item`` (None: none, any worker runs it)."""
    if item.nodeid.startswith(VLLM_ENGINE_MODULES):
        return VLLM_GROUP
    module_group = None
    for defs in item._fixtureinfo.name2fixturedefs.values():
        fixture = defs[-1]
        if not fixture.baseid:
            continue   # a plugin's (pytest's tmp_path_factory is session-scoped): nothing to share
        if fixture.scope in ("session", "package"):   # one group per conftest: its fixtures use each other
            return f"session fixtures of {fixture.baseid}"
        if fixture.scope in ("module", "class"):
            module_group = item.nodeid.split("::", 1)[0]
    return module_group


# -- controller ------------------------------------------------------------------------------
def _distributed_by_group(config: pytest.Config) -> bool:
    return config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _distributed_by_group(config):
        config.stash[_groups_dir_key] = Path(tempfile.mkdtemp(prefix="kvtier-xdist-groups-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    groups_dir = config.stash.get(_groups_dir_key, None)
    if groups_dir is not None:
        shutil.rmtree(groups_dir, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Tell each worker where to write its groups."""
    groups_dir = node.config.stash.get(_groups_dir_key, None)
    if groups_dir is not None:
        node.workerinput[GROUPS_DIR] = str(groups_dir)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if _distributed_by_group(config):
        return _group_scheduling()(config, log, config.stash[_groups_dir_key])
    return None


def _group_scheduling():
    """xdist's scheduler by scope (the biggest first), with our groups for scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def __init__(self, config, log, groups_dir: Path) -> None:
            super().__init__(config, log)
            self.groups_dir = groups_dir
            self.groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            # first called once every worker has collected (and so written its groups)
            if self.groups is None:
                self.groups = read_groups(self.groups_dir)
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling


def read_groups(groups_dir: Path) -> dict[str, str]:
    groups: dict[str, str] = {}
    for path in sorted(groups_dir.glob("*.json")):   # every worker collected the same tests
        groups.update(json.loads(path.read_text()))
    return groups


# -- worker ----------------------------------------------------------------------------------
@pytest.hookimpl(trylast=True)   # after any other hook has deselected or reordered tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups_dir = getattr(config, "workerinput", {}).get(GROUPS_DIR)
    if groups_dir is None:
        return   # not a worker of a --dist loadgroup run
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    path = Path(groups_dir) / f"{config.workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)   # whole or absent: the scheduler never reads half a file
