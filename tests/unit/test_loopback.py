"""The loopback world (fsdp8/app/bench/loopback.py) that times a world-N step on one device.

Its collectives must behave as N ranks holding this rank's tensors would, or the timings it
gives would be of some other program. Each check runs in a fresh interpreter: the loopback
replaces torch.distributed's collectives for the life of the process."""

import subprocess
import sys
import textwrap


def _run(body: str) -> str:
    script = textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_collectives_act_as_equal_ranks():
    out = _run(
        """
        import torch, torch.distributed as dist
        from fsdp8.app.bench import loopback
        loopback.init_loopback(4)
        assert dist.get_world_size() == 4 and dist.get_rank() == 0
        x = torch.arange(6.0)
        out = torch.full((24,), -1.0)
        assert dist.all_gather_into_tensor(out, x) is None
        assert torch.equal(out, x.repeat(4))
        # in place: the input is this rank's slot of the output
        buf = torch.zeros(4, 6); buf[0] = x
        work = dist.all_gather_into_tensor(buf.view(-1), buf[0], async_op=True)
        assert work.wait() and torch.equal(buf, x.repeat(4, 1))
        grads = torch.arange(24.0)
        shard = torch.empty(6)
        dist.reduce_scatter_tensor(shard, grads, op=dist.ReduceOp.SUM)
        assert torch.equal(shard, 4 * grads[:6]), shard
        dist.reduce_scatter_tensor(shard, grads, op=dist.ReduceOp.AVG)
        assert torch.equal(shard, grads[:6]), shard
        t = torch.tensor([1.5, -2.0])
        dist.all_reduce(t); assert torch.equal(t, torch.tensor([6.0, -8.0]))
        dist.all_reduce(t, op=dist.ReduceOp.MAX); assert torch.equal(t, torch.tensor([6.0, -8.0]))
        parts = [torch.empty(2) for _ in range(4)]
        dist.all_gather(parts, t); assert all(torch.equal(p, t) for p in parts)
        try:
            dist.all_gather_into_tensor(torch.empty(23), x)
        except ValueError as err:
            assert "world size" in str(err)
        else:
            raise AssertionError("a mis-sized all-gather passed")
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_engine_at_loopback_world_two_matches_the_model_it_stands_for():
    """With every weight made of two equal row halves, rank 0's half stands for both, so the
    loopback gather rebuilds the real model: fsdp8's loss equals the plain model's, and the
    updated shard equals the first half of the one-process update."""
    out = _run(
        """
        import copy, torch, torch.distributed as dist
        from fsdp8.app.bench import loopback
        import fsdp8
        loopback.init_loopback(2)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
        with torch.no_grad():
            for p in model.parameters():
                half = p.shape[0] // 2
                p[half:] = p[:half]
        reference = copy.deepcopy(model)
        sharded = fsdp8.fully_shard(model, units=[torch.nn.Linear], strategy="optim_grads_params")
        x = torch.randn(5, 8)
        loss = sharded(x).square().mean()
        want = reference(x).square().mean()
        assert torch.allclose(loss, want, rtol=1e-6, atol=0), (loss.item(), want.item())
        loss.backward()
        want.backward()
        torch.optim.SGD(sharded.parameters(), lr=0.1).step()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        for (name, p), q in zip(sharded.named_parameters(), reference.parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            assert local.shape[0] == q.shape[0] // 2, (name, local.shape)
            assert torch.allclose(local, q[: q.shape[0] // 2], rtol=1e-6, atol=1e-7), name
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_units_free_their_parameters_before_their_gradients_are_reduced():
    """ZeRO-3 at a loopback world of 2: in backward each unit's unsharded parameters are
    freed before its gradients are packed and reduced (the reduction's buffers must not
    stack on them at the step's peak), the root's at the last reduction."""
    out = _run(
        """
        import torch
        from fsdp8.app.bench import loopback
        loopback.init_loopback(2)
        import fsdp8
        from fsdp8.engine.unit import ShardedUnit
        from fsdp8.models.llama import Llama, preset

        log = []
        for name in ("reshard", "reduce_grads"):
            original = getattr(ShardedUnit, name)
            def logged(self, *a, _original=original, _name=name, **k):
                if _name == "reduce_grads" or self.state.name != "SHARDED":
                    log.append((_name, self.name))
                return _original(self, *a, **k)
            setattr(ShardedUnit, name, logged)
        torch.manual_seed(0)
        model = fsdp8.fully_shard(Llama(preset("tiny")), mesh=fsdp8.make_mesh())
        x = torch.randint(0, 256, (2, 16))
        for step in range(2):
            log.clear()
            model(x, x).backward()
        reduced = [unit for op, unit in log if op == "reduce_grads"]
        assert len(reduced) == 5, log  # four layers and the root
        for unit in reduced:
            first_reduce = log.index(("reduce_grads", unit))
            assert ("reshard", unit) in log[:first_reduce], (unit, log)
        print("ok")
        """
    )
    assert out.strip().endswith("ok")
