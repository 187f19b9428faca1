"""Fault-injection fixtures: agent loops on the scripted `FaultEngine` (see fault_engine.py)."""

import pytest

from fault_engine import FaultEngine
from turnrl.chat.parsers import HermesParser
from turnrl.engines.base import Sampling
from turnrl.rollout.loop import AgentLoop, Environment, Limits


@pytest.fixture(scope="session")
def fault_loop(smol_template):
    """fault_loop(scripts, env, limits=None, max_tokens=64) -> an AgentLoop on a FaultEngine (hermes parser)."""
    def make(scripts, env=None, limits=None, max_tokens=64):
        return AgentLoop(FaultEngine(smol_template, scripts), smol_template, HermesParser(), env or Environment(),
                         limits or Limits(), Sampling(max_tokens=max_tokens))
    return make
