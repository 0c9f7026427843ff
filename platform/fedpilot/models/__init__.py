"""Models and the personal/shared parameter split.

Contract for every model in the zoo, a plugin's (a `Net` subclass registered under the entry-point group
`fedpilot.models`, built as `Model(input_shape, num_classes, **options)`) and any model handed to the engine:
- exactly two children: `body` (inputs -> features) and `head` (an nn.Linear, features -> outputs), and
  forward(x) = head(body(x)); the engine computes body features once when only `head.*` is personal;
- functional-friendly: no BatchNorm (GroupNorm / LayerNorm instead), no buffers or state changed in forward
  and no data-dependent Python control flow, so it runs under torch.func.functional_call/vmap/grad with one
  parameter dict per client;
- seeded initialisation is the caller's job: torch.manual_seed before build_model.

Modules: options (the registry, each built-in model's option schema, the presets; torch-free, what validate reads),
zoo (`Net` and the built-in builders), split (the personal/shared split, adapters), memory (a client's training
memory). Import each name from its module; the package itself imports nothing.
"""
