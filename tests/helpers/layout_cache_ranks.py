"""Three saves of a DTensor model on 2 gloo ranks, its layout changed before the third.

Usage: layout_cache_ranks.py CKPT_DIR OUT_JSON [dotted checkpoint overrides...]

The model: ``w`` (Shard(0) over a mesh of both ranks: a sharding rule), ``s`` (Replicate on a
1-rank submesh per rank: no rule, planned from the ranks' gather) and a plain ``b``. Saves 1 and 2
have one layout (new values between them); before save 3 ``w`` is resized and resharded (Shard(1)).
The third checkpoint is loaded into a fresh model laid out Shard(0). Rank 0 writes OUT_JSON:
``plans`` (plans made after each save) and ``exact`` (the loaded weights equal the saved, per key).
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ranks  # this folder's shared rank start
from resilience.checkpoint import Checkpointer, TrainingState
from resilience.checkpoint.formats.model_io import load_model
from resilience.config import load_config
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler

ckpt_dir, out, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
world, rank = ranks.join()
mesh = init_device_mesh("cpu", (world,))
sub = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]


def make(w_shape, w_placement, seed):
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(torch.randn(w_shape), mesh, [w_placement]))
    model.s = torch.nn.Parameter(distribute_tensor(torch.randn(3, 2), sub, [Replicate()]))
    model.b = torch.nn.Parameter(torch.randn(4))
    return model


def full(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


model = make((6, 4), Shard(0), 1)
config = load_config(None, [f"checkpoint.checkpoint_dir={ckpt_dir}", "checkpoint.no_save_optim=true", *overrides]).checkpoint
ctx = DistContext.from_env()
ck = Checkpointer(config, ctx, state=TrainingState(model=model), scheduler=StepScheduler(num_epochs=1))
plans = []
for step in (1, 2, 3):
    if step == 2:
        with torch.no_grad():
            model.w.add_(1.0)
    if step == 3:
        model.w = torch.nn.Parameter(distribute_tensor(torch.randn(5, 7), mesh, [Shard(1)]))
    ck.scheduler.load_state_dict(StepScheduler(num_epochs=1, batches_in_epoch=step, global_step=step).state_dict())
    saved = ck.save()
    plans.append(ck._layout_cache.plans_made)
expected = full(model)
loaded = make((5, 7), Shard(0), 2)
load_model(saved, loaded, group=ctx.group)
got = full(loaded)
exact = {k: bool(torch.equal(got[k], v)) for k, v in expected.items()}
if rank == 0:
    out.write_text(json.dumps({"plans": plans, "exact": exact}))
ctx.close()
