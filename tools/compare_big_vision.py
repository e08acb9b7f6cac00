"""big_vision's own ``sharding``/``optax`` against ``bv_sharding.big_vision`` on one state.

Runs the part of big_vision's ``train.py`` the two modules serve, once with each: a
big_vision ViT's params shaped with ``jax.eval_shape``, ``optax.make`` on a section with
per-regex schedules, a frozen entry, ``lr_mults``, ``wd`` and clipping, ``infer_sharding``
of ``{"params", "opt"}`` under ``nn.logical_axis_rules`` on a 4 x 2 mesh, both inits jitted
into those shardings, then a few updates; and prints how many leaf specs agree and the
largest difference between the two runs' params. big_vision is not on PyPI; run it from a
checkout, as ``tools/record_big_vision.py`` is run::

    git clone https://github.com/google-research/big_vision /tmp/big_vision
    pip install --target /tmp/bv_deps einops
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        PYTHONPATH=/tmp/big_vision:/tmp/bv_deps:.:tools python tools/compare_big_vision.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from record_big_vision import stub_missing_imports

import bv_sharding.big_vision.optax as ours_optax
import bv_sharding.big_vision.sharding as ours_sharding

STEPS = 3
SECTION = dict(
    optax_name="scale_by_adam",
    optax=dict(mu_dtype="bfloat16"),
    lr=1e-3,
    wd=1e-4,
    grad_clip_norm=1.0,
    schedule=[
        (".*/head/.*", dict(decay_type="cosine", warmup_steps=2)),
        (".*embedding.*", None),
        (".*", dict(decay_type="linear", warmup_percent=0.1)),
    ],
    lr_mults=[(".*/bias", 2.0)],
)
SCHED_KW = dict(total_steps=20, batch_size=8, data_size=800)
STRATEGY = [
    (
        ".*/kernel",
        'shard_dim("model", -1, ignore_ndim_error=True)|fsdp(axis="data", min_size_to_shard_mb=0)',
    ),
    (".*", 'fsdp("data", 0)'),
]


def run(optax_module, sharding_module, init, params_shape, mesh) -> dict:
  """The train state's shardings and the params after each of ``STEPS`` updates."""
  config = ml_collections.ConfigDict(SECTION)
  tx, sched_fns = optax_module.make(config, nn.unbox(params_shape), sched_kw=SCHED_KW)
  opt_shape = jax.eval_shape(tx.init, params_shape)
  with nn.logical_axis_rules([("act_batch", "data")]):
    shardings = sharding_module.infer_sharding(
        {"params": params_shape, "opt": opt_shape}, strategy=STRATEGY, mesh=mesh
    )
  params = jax.jit(init, out_shardings=shardings["params"])(jax.random.key(0))
  jax.block_until_ready(jax.jit(tx.init, out_shardings=shardings["opt"])(params))
  params = nn.unbox(jax.device_get(params))  # The updates run on one device, eagerly.
  opt, trail = tx.init(params), []
  grads = jax.tree.map(lambda p: jnp.cos(3.0 * p), params)
  for _ in range(STEPS):
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    trail.append(params)
  return dict(
      shardings=shardings,
      trail=trail,
      count=optax_module.get_count(opt),
      schedules=[float(f(5)) for f in sched_fns],
      frozen=optax_module.replace_frozen(config.schedule, grads, 0.0),
  )


def same_spec(a, b) -> bool:
  """Whether two ``PartitionSpec``s place every dim alike (a missing trailing dim: ``None``)."""
  n = max(len(a), len(b))
  return (*a, *(None,) * (n - len(a))) == (*b, *(None,) * (n - len(b)))


def main():
  stub_missing_imports()
  from big_vision import optax as theirs_optax
  from big_vision import sharding as theirs_sharding
  from big_vision.models import vit

  model = vit.Model(num_classes=10, variant="Ti/16")
  init = lambda rng: model.init(rng, jnp.zeros((2, 64, 64, 3)))["params"]
  params_shape = jax.eval_shape(init, jax.random.key(0))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  theirs = run(theirs_optax, theirs_sharding, init, params_shape, mesh)
  ours = run(ours_optax, ours_sharding, init, params_shape, mesh)
  for part in ("params", "opt"):
    a, b = (jax.tree.leaves(r["shardings"][part]) for r in (theirs, ours))
    same = sum(same_spec(x.spec, y.spec) for x, y in zip(a, b))
    print(f"{part}: {len(a)} leaves (big_vision) / {len(b)} (drop-in), same spec: {same}")
  diff = max(
      float(jnp.max(jnp.abs(x - y)))
      for t, o in zip(theirs["trail"], ours["trail"])
      for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(o))
  )
  frozen = all(
      bool(jnp.all(x == y))
      for x, y in zip(jax.tree.leaves(theirs["frozen"]), jax.tree.leaves(ours["frozen"]))
  )
  print(f"max |params difference| over {STEPS} steps: {diff}")
  print(
      f"get_count: {theirs['count']} / {ours['count']}; schedules at step 5: "
      f"{theirs['schedules']} / {ours['schedules']}; replace_frozen equal: {frozen}"
  )


if __name__ == "__main__":
  main()
