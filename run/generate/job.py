"""What `generate`'s command line asks for, checked before any weight loads: the
prompts (or the demo's), the sampling, the cache length, the mesh, and a structured
output's constraint compiled by the grammar engine. Each refusal is one CLIError line.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flags import CLIError, check_output_file, check_output_folder, flag, int_list

DEMO_PROMPTS = ["The river flows", "Why is the sky blue?"]


@dataclasses.dataclass
class Job:
    """What the command line asks for, checked before any weight is loaded."""

    spec: object  # run.models.ModelSpec
    text: object  # run.text.Text, or None without tokenizer.json
    prompts: list[list[int]]
    demo: bool
    dtype_name: str
    sampling: object  # pipeline.programs.sampling.Sampling
    max_seq_len: int
    eos: tuple[int, ...]
    mesh: object  # jax.sharding.Mesh
    unused_devices: int  # devices this process sees that the mesh leaves out
    constraint: object = (
        None  # pipeline.structured.constraints.Constraint: --json-schema, --regex, --choice
    )
    grammars: object = None  # pipeline.structured.constraints.Grammars, with a constraint


# Every check of generate's flags before anything loads, in the order a user meets
# them; each failure is one CLIError line.
def read_job(args, engine_args: EngineArgs, runtime) -> Job:
    import jax

    from qwen3_spmd.model.split import TensorSplit
    from qwen3_spmd.pipeline.programs.sampling import Sampling
    from qwen3_spmd.pipeline.requests import check_request, fitting_seq_len
    from qwen3_spmd.pipeline.runtime import cp_cost

    procs, shape = runtime.procs, runtime.shape
    dtype = engine_args.dtype_name()
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    spec = engine_args.open_model()
    text = spec.text()
    prompts = _prompts(args, text)
    demo = args.model is None and not prompts
    if demo:
        prompts = [text.encode(p) for p in DEMO_PROMPTS]
        args.timeline = True  # the demo shows everything, checked where it can be
        args.check = args.check or not procs.many
    if not prompts:
        raise CLIError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3")
    if args.logits_out:
        check_output_file(args.logits_out, "--logits-out")
    if args.profile:
        check_output_folder(args.profile, "--profile")
    seq = shape.seq
    split = TensorSplit.of(shape.tensor, shape.data, args.expert_split)
    split.check(spec.cfg)
    mesh = runtime.mesh()
    if args.check and procs.many:
        raise CLIError(
            "--check reruns the requests on one device of one process, which a "
            "multi-process job cannot wait for: compare with a one-process run instead"
        )
    longest = max(len(p) for p in prompts)
    max_seq_len = args.max_seq_len or fitting_seq_len(longest, args.max_new_tokens, seq)
    check_request(spec.cfg, seq, max_seq_len, prompts, args.max_new_tokens)  # before loading
    constraint = _constraint(args, engine_args.structured_outputs().disable_additional_properties)
    grammars = _grammars(constraint, text, spec.cfg.V, spec.eos_ids())
    cp_cost.check_cp(split.local(spec.cfg), seq, args.cp)
    if procs.leader and max_seq_len % seq:
        print(
            f"note: --max-seq-len {max_seq_len} rounded up to {-(-max_seq_len // seq) * seq}, "
            f"a multiple of the {seq} seq devices (each holds the same number of slots)",
            file=sys.stderr,
        )
    return Job(
        spec=spec,
        text=text,
        prompts=prompts,
        demo=demo,
        dtype_name=dtype,
        sampling=sampling,
        max_seq_len=max_seq_len,
        eos=spec.eos_ids(),
        mesh=mesh,
        unused_devices=len(jax.devices()) - mesh.devices.size,
        constraint=constraint,
        grammars=grammars,
    )


def _prompts(args, text) -> list[list[int]]:
    prompts = [int_list(raw, "--prompt-ids") for raw in args.prompt_ids]
    for raw in args.prompt:
        if text is None:
            raise CLIError(
                "--prompt needs tokenizer.json in the checkpoint folder, which has "
                "none: pass --prompt-ids 1,2,3 instead"
            )
        prompts.append(text.encode(text.chat(raw, not args.no_thinking) if args.chat else raw))
    if args.chat and not args.prompt:
        raise CLIError("--chat applies to --prompt TEXT prompts, and none was given")
    if args.no_thinking and not args.chat:
        raise CLIError("--no-thinking applies to --chat prompts: add --chat")
    return prompts


def _constraint(args, closed: bool):
    """The structured output --json-schema, --regex or --choice asks for (one at most),
    or None; closed: a schema's objects take only the properties they list."""
    from qwen3_spmd.run.request_fields import constraint

    given = [f for f in ("json_schema", "regex", "choice") if getattr(args, f) is not None]
    if len(given) > 1:
        raise CLIError(f"{' and '.join(map(flag, given))}: give one")
    if args.json_schema is not None:
        try:
            with open(args.json_schema) as f:
                return constraint("json", json.load(f), closed=closed)
        except (OSError, ValueError) as e:
            raise CLIError(f"--json-schema {args.json_schema}: cannot read it ({e})") from None
    if args.regex is not None:
        return constraint("regex", args.regex)
    if args.choice is not None:
        options = [c for c in args.choice.split(",") if c]
        if not options:
            raise CLIError("--choice: give at least one option (A,B,...)")
        return constraint("choice", options)
    return None


def _grammars(constraint, text, vocab: int, eos: tuple[int, ...]):
    """The grammar engine for `constraint` (compiled now, before any weight is loaded),
    or None without one."""
    from qwen3_spmd.pipeline.structured.constraints import ConstraintError, Grammars

    if constraint is None:
        return None
    grammars = Grammars.of_text(text, vocab, eos)
    if grammars is None:
        raise CLIError("--json-schema, --regex and --choice need the model's tokenizer.json")
    try:
        grammars.compile(constraint)
    except ConstraintError as e:
        raise CLIError(f"the structured output is refused: {e}") from None
    return grammars
