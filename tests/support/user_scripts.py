"""Training scripts written as a user writes them (plain torch and the SDK), for the dev-cluster tests."""

import textwrap

#: A plain DDP script: SGD without momentum, ``model.state_dict()`` and ``opt.state_dict()``
#: handed to ``sdk.save`` as they are, ``sdk.resume()`` fed back through ``load_state_dict``.
#: Deterministic: the batch of step s is seeded by (s, rank). Test switches: raise on one
#: node at one step, and call ``sdk.check_replicas`` after every optimizer step.
USER_SCRIPT = textwrap.dedent('''\
    import argparse, os, time
    import torch, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from clusterops import sdk

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default=None)
    p.add_argument("--raise-on-node", default=None)
    p.add_argument("--raise-at", type=int, default=0)
    p.add_argument("--check-replicas", action="store_true")
    p.add_argument("--hang-on-node", default=None)
    p.add_argument("--hang-at", type=int, default=0)
    a = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    d = sdk.init_distributed("gloo")
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    r = sdk.resume()
    if r is not None:
        model.module.load_state_dict(r.state["model"])
        opt.load_state_dict(r.state["opt"])
        start = r.step
    for step in range(start + 1, a.steps + 1):
        if a.raise_on_node and os.environ.get("SLURMD_NODENAME") == a.raise_on_node and step == a.raise_at:
            raise RuntimeError(f"scratch on {a.raise_on_node} is not writable")
        if a.hang_on_node and os.environ.get("SLURMD_NODENAME") == a.hang_on_node and step == a.hang_at:
            time.sleep(3600)          # stuck outside any collective (a data loader, a bad device)
        g = torch.Generator().manual_seed(1000 * step + d.rank)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.check_replicas:
            sdk.check_replicas(step, model.parameters())
        sdk.heartbeat(step, loss=loss.item())
        if a.ckpt_every and step % a.ckpt_every == 0:
            sdk.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, step)
        time.sleep(a.step_sleep)
    if d.rank == 0 and a.out:
        torch.save(model.module.state_dict(), a.out)
    sdk.shutdown()
    ''')
