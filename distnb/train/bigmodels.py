"""Kernel side of models bigger than one rank: meta-device models and what the ranks can hold.

A notebook model built on the meta device (``with torch.device("meta"): net = Net()``, or Hugging
Face's ``from_config`` under it) has a structure and no data. It travels as that structure; the
ranks materialise and initialise only what they hold (:mod:`distnb.engine.strategies.materialize`), from the
notebook's torch generator state at the time it is sent, so the weights equal a one-process build
after the same ``torch.manual_seed``. The kernel's model stays on meta: the trained weights live on
the ranks (``%dist save DIR`` writes them; they are not loaded back into the notebook). A later cell that
places the model anew (another ``--strategy``, other distribution options) keeps them: the ranks carry
each tensor into the new placement (:func:`carry_or_reinit`, :mod:`distnb.engine.train.carry`); only a model
rebuilt in the notebook, ``--reset``, or a re-formed process group start from a fresh initialisation.

Before anything is sent, :func:`check_init` refuses a module that could not be initialised and
:func:`check_fit` a strategy whose share of the model does not fit what each rank can hold.
"""

from __future__ import annotations

from distnb.core import calls, hfinit
from distnb.core.errors import PlanError
from distnb.core.tables import count
from distnb.train import pretrained


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def on_meta(model) -> bool:
    """Whether ``model`` (a torch.nn.Module) holds a parameter or buffer on the meta device."""
    return any(t.is_meta for t in model.state_dict(keep_vars=True).values()) or \
        any(b.is_meta for b in model.buffers())


def check_init(model, plan) -> None:
    """Refuse a meta model with a module that holds meta tensors itself and has no ``reset_parameters``.

    With ``--init`` the function initialises every module, so nothing is refused here; neither is a
    module inside a ``transformers.PreTrainedModel``, which the ranks initialise with the model's
    ``_init_weights`` (:mod:`distnb.core.hfinit`).

    Raises
    ------
    PlanError
        Naming the first such module as ``blocks.3.norm (MyNorm)`` and the ways out.
    """
    if plan.init is not None:
        return
    loaded = pretrained.provided_names(plan, model)  # --load fills these: no init needed
    found = hfinit.owners(model)  # a transformers model's modules: its _init_weights initialises them
    for name, mod in model.named_modules():
        own = [t for key, t in [*mod._parameters.items(), *mod._buffers.items()]
               if t is not None and t.is_meta and (f"{name}.{key}" if name else key) not in loaded]
        if own and not callable(getattr(mod, "reset_parameters", None)) and hfinit.hf_init(found, name, mod, {}) is None:
            raise PlanError(f"{plan.model} is on the meta device and its module {name or '(the root)'} "
                            f"({type(mod).__name__}) has no reset_parameters() to initialise it on the ranks; pass "
                            f"--init FN, a notebook function f(module) that initialises the tensors a module holds "
                            f"itself, or give {type(mod).__name__} a reset_parameters()")


def model_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers (each tensor once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


#: Tensors of optimizer state per trainable parameter, for the built-in optimizers as distnb makes them
#: (``torch.optim.SGD`` without momentum keeps none; Adam and AdamW keep two moments).
OPTIMIZER_STATES = {"sgd": 0, "adam": 2, "adamw": 2}


def trainable_bytes(model) -> int:
    """Bytes of ``model``'s parameters that require gradients (each once): its gradients' size."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def replica_need(model, plan) -> tuple[int, str]:
    """Bytes one whole replica takes while training, and what they are.

    The parameters and buffers, a gradient per trainable parameter (ddp's buckets are those
    gradients: distnb builds DDP with ``gradient_as_bucket_view``), and the optimizer's state
    (:data:`OPTIMIZER_STATES`; a notebook optimizer's state is not counted, and said so). Activations,
    communication buffers and the runtime come on top: a lower bound.
    """
    whole, grads = model_bytes(model), trainable_bytes(model)
    name = (plan.optimizer or "sgd").lower()
    states = OPTIMIZER_STATES.get(name)
    parts = f"the model ({_gib(whole)}), its gradients ({_gib(grads)})"
    if states is None:
        return whole + grads, f"{parts}; the state of optimizer {plan.optimizer} is not counted"
    if states == 0:
        return whole + grads, f"{parts} and {name}'s state (none)"
    return whole + grads * (1 + states), f"{parts} and {name}'s state ({_gib(grads * states)})"


def rank_need(model, plan, world_size: int) -> tuple[int, str]:
    """Bytes of the model one rank holds at least for ``plan.strategy``, and how that was counted.

    Each counts what :func:`replica_need` says a whole replica takes (parameters, buffers, gradients,
    optimizer state). ddp: all of it on every rank. ps: the parameters and gradients (the servers keep
    the optimizer's state). fsdp: a 1/world_size share of it plus the largest FSDP unit gathered whole
    with its unsharded gradient. Other strategies: their 1/world_size share. A lower bound: activations,
    communication buffers and the runtime come on top.
    """
    replica, parts = replica_need(model, plan)
    if plan.strategy == "ddp":
        return replica, f"{parts}: ddp keeps a full replica on every rank"
    if plan.strategy == "ps":
        both = model_bytes(model) + trainable_bytes(model)
        return both, (f"the model and its gradients ({_gib(both)}): every ps worker holds a full replica; the "
                      f"servers keep the optimizer's state")
    share = replica // world_size
    if plan.strategy == "fsdp":
        from distnb.engine.strategies.fsdp import default_units  # imports torch: at first use

        units = plan.fsdp_units or default_units(model)
        largest = max((model_bytes(model.get_submodule(u)) + trainable_bytes(model.get_submodule(u)) for u in units),
                      default=0)
        return share + largest, (f"{_gib(share)} as 1/{world_size} of {parts}, plus its largest FSDP unit gathered "
                                 f"whole with its gradient ({_gib(largest)})")
    return share, f"1/{world_size} of {parts}"


def check_fit(session, plan, model) -> None:
    """Refuse a plan whose per-rank share cannot fit what the ranks have free (asked of every rank).

    A rank's room is its GPU's free memory or its memory cgroup's, else its host's available memory
    shared by the ranks on that host.

    Raises
    ------
    PlanError
        Saying what each rank would need and what the tightest rank has.
    """
    cluster = session.cluster
    need, how = rank_need(model, plan, session.world_size)
    try:
        rooms = cluster.wait_all(cluster.apply_all(calls.capacity), timeout=cluster.spec.timeout,
                                 what="asking the ranks' free memory")
    except Exception:  # a rank that cannot say: the strategy finds out itself
        return
    per_host: dict = {}
    for room in rooms:
        per_host[room["host"]] = per_host.get(room["host"], 0) + 1
    for rank, room in enumerate(rooms):
        have = room["bytes"] if room["scope"] == "rank" else room["bytes"] // per_host[room["host"]]
        if need > have:
            fix = ("use --strategy fsdp (or tensor, pipeline) to shard it" if plan.strategy in ("ddp", "ps")
                   else "use more ranks, smaller --fsdp-units, or a bigger machine")
            where = "free" if room["scope"] == "rank" else f"of its host's available memory, shared by " \
                f"{count(per_host[room['host']], 'rank')}"
            raise PlanError(f"--strategy {plan.strategy} cannot fit {plan.model} ({_gib(model_bytes(model))}): each "
                            f"rank would need {_gib(need)} for {how}, and rank {rank} has {_gib(have)} {where}; {fix}")


def rng_state() -> bytes:
    """The notebook's torch generator state, which the ranks initialise a meta model from."""
    import torch

    return torch.random.get_rng_state().numpy().tobytes()


def sent_note(model, carried: bool = False) -> str:
    """What the line saying a model was sent adds for a meta model ("" for others; ``carried``: the ranks keep
    the weights they trained, :func:`carry_or_reinit`)."""
    if not on_meta(model):
        return ""
    return "; on the meta device: the ranks keep their trained weights" if carried else \
        "; on the meta device: each rank initialises the part it holds"


def reinit_note(name: str, why: str) -> str:
    """What a cell says when a meta model the ranks held (and trained) is sent again and starts from a new init."""
    return (f"{name} is on the meta device in the notebook and {why}, so sending it again initialises it afresh on "
            f"the ranks: the weights they trained are not carried over (%dist save DIR before, then %dist load DIR, "
            f"keeps them)")


#: Why the ranks no longer hold a model (:attr:`distnb.train.holdings.Holdings.gone`: the model's name -> (the
#: fingerprint of what they held, why), kept until the model is sent again, across restarts): its next cell says so,
#: and calls it changed only when it changed in the notebook since. After their world ended:
RESTARTED = ("the ranks were started again since they trained it (%dist restart, %dist stop and start, or an automatic "
             "restart): its weights went with them")
#: After an interrupt stopped them where they were (the replicas may be steps apart, the group is broken).
INTERRUPTED = "an interrupt stopped the ranks where they were, which broke the process group that held its weights"


def carry_or_reinit(session, plan, model, fp, last) -> bool:
    """Before a meta model the ranks held is sent again: have them keep its trained weights, or say why not.
    Returns whether they keep them.

    The ranks carry the weights into the new placement (:mod:`distnb.engine.train.carry`) when the notebook's
    model is the one they trained (same fingerprint), ``--reset`` was not given, and the process group it
    was placed on is still the one now (``last``: its (strategy key, generation) before this cell). Any
    model not on meta, or new to the ranks, is left alone.
    """
    held = session.holdings
    if not on_meta(model) or plan.reset or plan.model not in {**held.models, **held.trained_steps, **held.gone}:
        return False
    same_group = last is not None and last[1] == held.generation
    keep = held.models.get(plan.model) == fp and same_group
    cluster = session.cluster
    cluster.wait_all(cluster.apply_all(calls.carry_weights, plan.model, keep), timeout=cluster.spec.timeout,
                     what=f"keeping {plan.model}'s weights")
    if keep:
        print(f"distnb: {plan.model} is on the meta device in the notebook: the ranks keep the weights they trained "
              f"and place them anew for --strategy {plan.strategy}")
    else:
        print(f"distnb: {reinit_note(plan.model, _why_not_kept(held, plan.model, fp))}")
    return keep


def _why_not_kept(held, name: str, fp) -> str:
    """Why the ranks cannot keep the weights of the meta model ``name`` (its fingerprint now ``fp``) they trained:
    a change in the notebook since the ranks got it, else why they no longer hold it
    (:attr:`~distnb.train.holdings.Holdings.gone`)."""
    if name in held.models:
        before, why = held.models[name], "its process group was re-formed since it was placed (its sharded weights " \
            "went with it)"
    else:
        before, why = held.gone.get(name, (None, "the ranks no longer hold the weights they trained"))
    return "changed in the notebook" if before is not None and before != fp else why


def stays_note(name: str) -> str:
    """What the cell says about a meta model's weights."""
    return (f"{name} is on the meta device in the notebook, so its weights stay on the ranks (each holds its part) "
            f"and do not come back; write them with %dist save DIR, or read one with %dist pull")


def check_before_sending(session, plan, model) -> None:
    """The checks above, for a model about to be sent: a meta one's initialisation, and whether it fits.

    A model held in the notebook is checked for fit only when it is bigger than 64 MiB (a round trip to
    the ranks, not worth it for the small models where nothing can run out).
    """
    meta = on_meta(model)
    if meta:
        check_init(model, plan)
    if meta or model_bytes(model) > (64 << 20):
        check_fit(session, plan, model)


def send_calls(cluster, plan, model, steps, payload, descs, sent):
    """The calls that send ``model`` (packed as ``payload``/``descs``, bytes in ``sent``) to every rank.

    A strategy that shards first, or a meta model, goes as its structure: the ranks distribute it
    before they materialise their part (:func:`distnb.engine.train.install.place_model`); otherwise
    every rank receives the whole model (:func:`distnb.engine.train.install.install_model`).
    """
    from distnb.engine import strategies  # imports torch: at first use

    meta = on_meta(model)
    if not meta and not strategies.strategy_class(plan.strategy).shards_first:
        return cluster.apply_all(calls.install_model, plan.model, payload, descs, steps, *sent)
    return cluster.apply_all(calls.place_model, plan.model, plan.to_dict(), steps, payload, descs,
                             rng_state() if meta else None, *sent)
