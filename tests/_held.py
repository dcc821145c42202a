"""Every tensor an optimizer holds, found by walking its attributes: what `local_state_bytes()`
must count (parameters and gradients are not optimizer state)."""

import torch


def held_tensor_bytes(opt) -> int:
    """Bytes of the distinct storages reachable from `opt`'s attributes (through containers
    and this package's objects), except the parameters' and gradients' buffers."""
    from vescale_optim.units.unit import LOW_PRECISION

    skip = set()
    for u in opt.units:  # parameters and gradients, whole or sharded (an fp32 master is state)
        own = [u.full.data, u.grads.full.data, u.grads.shard]
        own += [] if u.orig_dtype in LOW_PRECISION else [u.shard]
        skip.update(t.untyped_storage().data_ptr() for t in own + u.grads.placeholders + u.stand_ins)
    for g in opt.param_groups:
        for p in g["params"]:
            skip.update(t.untyped_storage().data_ptr() for t in (p, p.grad) if t is not None)
    storages, seen, todo = {}, set(), [vars(opt)]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            if s.data_ptr() not in skip and s.nbytes():
                storages[s.data_ptr()] = s.nbytes()
        elif isinstance(x, dict):  # what the dict holds (`opt.state` decodes 8-bit state when read)
            todo.extend(dict.keys(x))
            todo.extend(dict.values(x))
        elif isinstance(x, list | tuple | set | frozenset):
            todo.extend(x)
        elif type(x).__module__.startswith("vescale_optim") and hasattr(x, "__dict__"):
            todo.append(vars(x))
    return sum(storages.values())
