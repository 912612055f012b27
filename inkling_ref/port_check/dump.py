"""The port dump: what an engine's MTP depths computed over a few decoding steps, in one safetensors file.

One dump holds one sequence. A *step* is one draft phase: the depths ran while n tokens were committed
(x_0 .. x_{n-1}, x_{n-1} pending) and drafted d_1..d_k. Rows are indexed by the trunk position p of the
hidden H_p they start from (docs/spec/mtp-cycle.md §1: depth m at row p reads x_{p+m+1}).

    required                                                     what it enables
    tokens        int [N]        the committed sequence after the last step      token slots, accept counts
    hidden        float [P, H]   H_p for p = 0..P-1 as handed to depth 0          every recomputation
    step_n        int [S]        n when each step's depths ran
    step_k        int [S]        depths run in the step (the engine's k)
    step_drafts   int [S, K]     d_1..d_k of the step (-1 beyond k)               the draft check
    row_step, row_depth, row_position   int [R]   which rows each depth ran       stale-row check
    row_hidden    float [R, H]   each row's output (what the next depth and the LM head read)
    optional
    row_token     int [R]        the token id each row consumed                  names a token-slot mistake
    row_logits    float [R, V]   each row's logits                                argmax from the engine's own LM head
    row_hidden_in float [R, H]   the hidden each row read                         checks depth m reads depth m-1
    checkpoint_probe float [16]  MTP depth 0's input_proj.weight[0, :16]          names a dump from another checkpoint

Metadata (safetensors header): format, version (required); engine, dtype, draft_sampling (greedy or
sampled: sampled drafts are not compared with the argmax). docs/port_checker.md is the full contract.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .schedule import Problem, check_fields, sort_rows

FORMAT, VERSION = "inkling-mtp-port-dump", "1"
INT, FLOAT = "int", "float"
REQUIRED = {"tokens": INT, "hidden": FLOAT, "step_n": INT, "step_k": INT, "step_drafts": INT,
            "row_step": INT, "row_depth": INT, "row_position": INT, "row_hidden": FLOAT}
OPTIONAL = {"row_token": INT, "row_logits": FLOAT, "row_hidden_in": FLOAT, "checkpoint_probe": FLOAT}
RANK = {"tokens": 1, "hidden": 2, "step_n": 1, "step_k": 1, "step_drafts": 2, "row_step": 1, "row_depth": 1,
        "row_position": 1, "row_hidden": 2, "row_token": 1, "row_logits": 2, "row_hidden_in": 2,
        "checkpoint_probe": 1}
INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PROBE = 16   # checkpoint_probe = model.mtp.layers.0.input_proj.weight[0, :PROBE]


class DumpError(ValueError):
    """A dump that cannot be checked. The message is one line naming the file and the field."""


@dataclass
class PortDump:
    """A dump read into memory (CPU tensors; int fields as int64), rows sorted by (step, depth, position)."""
    path: str
    fields: dict[str, torch.Tensor]
    metadata: dict[str, str]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.fields.get(name)

    @property
    def num_rows(self) -> int:
        return len(self.fields["row_step"])

    @property
    def hidden_size(self) -> int:
        return self.fields["hidden"].shape[1]

    @property
    def engine_dtype(self) -> torch.dtype:
        return self.fields["row_hidden"].dtype

    @property
    def greedy_drafts(self) -> bool:
        return self.metadata.get("draft_sampling", "greedy") == "greedy"


# ---------------------------------------------------------------------- writing
@dataclass
class DumpRecorder:
    """Collects one sequence's depth rows as an engine runs them; `write` makes the dump.

    The calls a port adds to its draft loop (one sequence of the batch):
        rec.step(n, k)                                   a draft phase starts, n tokens committed
        rec.depth_rows(m, positions, out, tokens=..., hidden_in=..., logits=...)   after each depth call
        rec.drafts([d_1, .., d_k])                       the step's drafts
        rec.write(path, committed_tokens)                at the end
    H is taken from depth 0's hidden_in (or given with rec.trunk_hidden(positions, H)). Rows of a
    depth's prefill pass belong to the first step (their tokens are committed ones)."""
    steps: list[tuple[int, int, list[int]]] = field(default_factory=list)   # (n, k, drafts)
    rows: list[dict] = field(default_factory=list)
    H: dict[int, torch.Tensor] = field(default_factory=dict)

    def step(self, n: int, k: int) -> None:
        self.steps.append((int(n), int(k), []))

    def drafts(self, tokens) -> None:
        self.steps[-1][2][:] = [int(t) for t in tokens]

    def trunk_hidden(self, positions, hidden: torch.Tensor) -> None:
        for p, h in zip(torch.as_tensor(positions).tolist(), hidden.detach().cpu()):
            self.H[p] = h

    def depth_rows(self, depth: int, positions, hidden_out: torch.Tensor, tokens=None, hidden_in=None,
                   logits=None) -> None:
        """positions [T], hidden_out [T, H]; tokens [T], hidden_in [T, H], logits [T, V] optional."""
        if not self.steps:
            raise ValueError("DumpRecorder.depth_rows before DumpRecorder.step: start a step first")
        positions = torch.as_tensor(positions).tolist()
        if depth == 0 and hidden_in is not None:
            self.trunk_hidden(positions, hidden_in)
        for t, p in enumerate(positions):
            self.rows.append({"step": len(self.steps) - 1, "depth": depth, "position": p,
                              "hidden": hidden_out[t].detach().cpu(),
                              "token": None if tokens is None else int(tokens[t]),
                              "hidden_in": None if hidden_in is None else hidden_in[t].detach().cpu(),
                              "logits": None if logits is None else logits[t].detach().cpu()})

    def write(self, path, tokens, metadata: dict | None = None, checkpoint_probe: torch.Tensor | None = None) -> Path:
        """Write the dump; tokens: the committed sequence after the last step."""
        P = max(self.H) + 1 if self.H else 0
        missing = [p for p in range(P) if p not in self.H]
        if missing:
            raise ValueError(f"DumpRecorder: no trunk hidden for positions {missing[:8]}: record depth 0's "
                             "hidden_in or call trunk_hidden")
        K = max(k for _, k, _ in self.steps)
        out = {"tokens": torch.tensor(list(tokens), dtype=torch.int64),
               "hidden": torch.stack([self.H[p] for p in range(P)]),
               "step_n": torch.tensor([n for n, _, _ in self.steps]),
               "step_k": torch.tensor([k for _, k, _ in self.steps]),
               "step_drafts": torch.tensor([d + [-1] * (K - len(d)) for _, _, d in self.steps]).reshape(-1, K),
               "row_step": torch.tensor([r["step"] for r in self.rows]),
               "row_depth": torch.tensor([r["depth"] for r in self.rows]),
               "row_position": torch.tensor([r["position"] for r in self.rows]),
               "row_hidden": torch.stack([r["hidden"] for r in self.rows])}
        for name, key in (("row_token", "token"), ("row_hidden_in", "hidden_in"), ("row_logits", "logits")):
            if all(r[key] is not None for r in self.rows):
                values = [r[key] for r in self.rows]
                out[name] = torch.tensor(values) if key == "token" else torch.stack(values)
        if checkpoint_probe is not None:
            out["checkpoint_probe"] = checkpoint_probe.detach().float().cpu().reshape(-1)[:PROBE]
        meta = {"format": FORMAT, "version": VERSION, "dtype": str(out["row_hidden"].dtype).removeprefix("torch."),
                **{k: str(v) for k, v in (metadata or {}).items()}}
        save_file({k: v.contiguous() for k, v in out.items()}, str(path), metadata=meta)
        return Path(path)


def probe_of(input_proj_weight: torch.Tensor) -> torch.Tensor:
    """The checkpoint_probe of a head whose depth 0 has this input_proj weight [H, 2H]."""
    return input_proj_weight[0, :PROBE].detach().float().cpu()


# ---------------------------------------------------------------------- reading
def read_dump(path) -> PortDump:
    """Read and check a dump (everything that does not need the checkpoint); DumpError otherwise."""
    where = str(path)
    p = Path(path)
    if not p.exists():
        raise DumpError(f"{where}: no such file")
    if not p.is_file():
        raise DumpError(f"{where} is a directory; pass the dump file (a .safetensors file)")
    try:
        with safe_open(p, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            names = list(f.keys())
            if metadata.get("format") != FORMAT:
                raise DumpError(f"{where}: not a port dump (its safetensors metadata lacks format={FORMAT}); "
                                "write it with DumpRecorder.write or as docs/port_checker.md says")
            if metadata.get("version") != VERSION:
                raise DumpError(f"{where}: dump format version {metadata.get('version')!r}; this checker reads "
                                f"version {VERSION}")
            missing = [n for n in REQUIRED if n not in names]
            if missing:
                unknown = [n for n in names if n not in REQUIRED and n not in OPTIONAL]
                close = {n: difflib.get_close_matches(n, unknown, 1, 0.8) for n in missing}
                hint = "".join(f" (the file has {c[0]!r})" for c in close.values() if c)
                raise DumpError(f"{where}: missing required field(s) {', '.join(map(repr, missing))}{hint}; a dump "
                                f"holds {', '.join(REQUIRED)}")
            fields = {n: f.get_tensor(n) for n in names if n in REQUIRED or n in OPTIONAL}
    except SafetensorError as e:
        raise DumpError(f"{where}: not a readable safetensors file ({e})") from None
    for name, t in fields.items():
        kind = REQUIRED.get(name) or OPTIONAL[name]
        if kind == INT and t.dtype not in INT_DTYPES:
            raise DumpError(f"{where}: field {name!r} must hold integers (int32 or int64), got {t.dtype}")
        if kind == FLOAT and t.dtype not in FLOAT_DTYPES:
            raise DumpError(f"{where}: field {name!r} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dim() != RANK[name]:
            raise DumpError(f"{where}: field {name!r} must have {RANK[name]} dimension(s), got shape {list(t.shape)}")
        if kind == INT:
            fields[name] = t.long()
    try:
        check_fields(fields)
    except Problem as e:
        raise DumpError(f"{where}: {e}") from None
    return PortDump(where, sort_rows(fields), dict(metadata))
