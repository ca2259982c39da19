"""The replica set's options and the router's key, without starting Ray (tests/e2e/test_replicas.py runs one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from serval.cluster.config import ReplicaConfig
from serval.cluster.wire import block_hashes
from serval.entrypoints.cli import replica_config


def test_no_replicas_flag_means_no_replica_set():
    assert replica_config({}) is None


def test_replica_flags_become_the_config():
    config = replica_config({"replicas": 3, "replica_threads": 2, "replica_routing": "round_robin"})
    assert config == ReplicaConfig(num_replicas=3, threads_per_replica=2, routing="round_robin")


def test_replicas_refuse_tensor_parallelism_for_now():
    with pytest.raises(ValueError, match="tensor-parallel"):
        replica_config({"replicas": 2, "tensor_parallel_size": 2})


@pytest.mark.parametrize("name", ["replica_threads", "ray_address", "replica_routing"])
def test_replica_flags_need_replicas(name):
    with pytest.raises(ValueError, match="needs --replicas"):
        replica_config({name: "x"})


@pytest.mark.parametrize(
    "fields", [{"num_replicas": 0}, {"threads_per_replica": 0}, {"routing": "random"}, {"max_imbalance": -1}]
)
def test_bad_replica_config_is_refused(fields):
    with pytest.raises(ValueError):
        ReplicaConfig(**fields)


def test_block_hashes_name_equal_heads_equally():
    a = block_hashes(list(range(50)), 16, 64)
    b = block_hashes(list(range(48)) + [7, 7, 7], 16, 64)
    c = block_hashes([99] + list(range(1, 50)), 16, 64)
    assert len(a) == 3 and a == b[:3]  # full blocks only; the partial tail is not named
    assert not set(a) & set(c)  # a different first token changes every later hash (a chain)
    assert block_hashes(list(range(50)), 16, 64, seed="adapter") != a  # an adapter's blocks are its own
    assert len(block_hashes(list(range(10_000)), 16, 64)) == 64  # the router looks at the head only


def test_the_single_process_server_never_imports_ray():
    code = (
        "import sys, serval.entrypoints.cli, serval.serving.frontend, serval.api.app, serval.cluster.config;"
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_grammar_constraint_crosses_to_a_replica_and_starts_afresh():
    """A request's grammar matcher is pickled for the replica (xgrammar's objects don't pickle themselves):
    the copy allows exactly what the original allows, and follows the same tokens the same way."""
    import pickle

    from serval.model_source import resolve_model
    from serval.serving.structured import GrammarCompiler
    from serval.serving.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(resolve_model(None))
    grammar = GrammarCompiler(tokenizer).compile_now({"type": "json_object"})
    original = grammar.new_constraint()
    copy = pickle.loads(pickle.dumps(grammar.new_constraint()))
    for token_id in tokenizer.encode('{"a": 1}', add_special_tokens=False):
        assert copy.allowed_token_bitmask().equal(original.allowed_token_bitmask())
        original.accept_token(token_id)
        copy.accept_token(token_id)
    assert copy.is_finished == original.is_finished
