"""The speculative algorithms Tandem knows, one torch-free `SpeculativeAlgorithm` entry each (SGLang registers its
algorithms the same way): names, what the draft needs from the target, chain or tree, overlap / adaptive support,
the (steps, topk, num_draft_tokens) auto-defaults and checks, the draft model it loads, its proposer factory and its
extra flags. The CLI, the launcher, the services and the gateway read an entry; none of them compares names.

Knows no torch, grpc or CLI parser: a proposer factory is named as "module:function" and imported on use.
"""
from __future__ import annotations

import enum
import importlib
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class TargetFeatures(enum.Enum):
    """What the draft needs from the target besides token ids."""

    NONE = "none"
    FINAL_HIDDEN = "final_hidden"  # the final-norm hidden state of every committed token (EAGLE-2 heads, NEXTN)
    AUX_LAYERS = "aux_layers"  # the head's aux layers' hidden states, concatenated (EAGLE-3)
    BLOCK_FEATURES = "block_features"  # hidden states of configured layers for block drafts (DFLASH)


class DraftModel(enum.Enum):
    """What the draft service loads."""

    NONE = "none"  # no model (NGRAM's trie; plain decoding)
    CHECKPOINT = "checkpoint"  # a small LM (--speculative-draft-model-path; default: the bundled demo draft)
    HEAD = "head"  # a head trained on one target (required; default: the bundled target's own head)
    BUILT_IN = "built_in"  # the proposer builds its own (SYNTHETIC's random head)


class ShapeRule(enum.Enum):
    """How (num_steps, topk, num_draft_tokens) are defaulted and checked."""

    NONE = "none"  # no drafts: plain decoding
    BEAM = "beam"  # SGLang's triple: all three or none; topk 1 is a chain (ndt = steps + 1)
    TRIE = "trie"  # the n-gram trie: ndt given, topk := its max BFS breadth, steps := ndt // topk
    BLOCK = "block"  # one block draft per step (DFLASH): steps = topk = 1, ndt = the block size
    UNO = "uno"  # UNO: topk 1 = linear (ndt = draft width F), topk K > 1 = tree (F = steps + 1, ndt = Q verify nodes)


@dataclass(frozen=True)
class AlgorithmFlag:
    """A flag only one algorithm reads; added to the speculative-decoding group of every service's parser."""

    flag: str
    help: str
    type: type | None = str  # None = a store_true switch
    default: object = None
    choices: tuple | None = None
    forward: bool = True  # `tandem serve` passes it (when set) to the model services
    aliases: tuple[str, ...] = ()  # other spellings the parser accepts (SGLang's older names)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class SpeculativeAlgorithm:
    """One algorithm's capabilities. `unsupported` set: SGLang has it, Tandem parses the name and refuses it."""

    name: str
    aliases: tuple[str, ...] = ()
    drafts: bool = True  # False: plain decoding (no draft service, empty trees)
    unsupported: str = ""
    benchmark_only: bool = False
    target_features: TargetFeatures = TargetFeatures.NONE
    shape_rule: ShapeRule = ShapeRule.BEAM
    tree: bool = True  # False: chain drafts only
    # Targets whose auto-default is SGLang's 5/4/8 tree (every other target: the 3/1/4 chain).
    tree_default_architectures: tuple[str, ...] = ()
    supports_overlap: bool = False  # the proposer can pre-draft the next step from a guess (Proposer._guess_next)
    supports_adaptive: bool = False  # chain drafts of any depth per step (gateway/adaptive.py)
    # The draft can sample chains from its own distribution q and send q (--speculative-use-rejection-sampling)
    supports_rejection_sampling: bool = False
    draft_model: DraftModel = DraftModel.NONE
    bundled_draft: str | None = None  # folder under models/ (DraftModel.CHECKPOINT / HEAD defaults)
    token_map_ignored: str | None = "FR-Spec maps apply to EAGLE (EAGLE-2) heads only"  # None: reads the token map
    # The target checkpoint's own MTP / NextN layers (config num_nextn_predict_layers, runtime/models/mtp.py) are
    # the draft: "always" when the target has them (a draft path given is not needed), "default" only when no other
    # draft path resolves (an explicit or bundled head wins), "" never. Such an entry also runs multi-layer EAGLE
    # (`multi_layer_shape`: one MTP layer per draft step) on a checkpoint with several.
    mtp_draft: str = ""
    proposer: str = ""  # "module:function(build) -> (Proposer, path)", see tandem/services.py DraftBuild
    flags: tuple[AlgorithmFlag, ...] = ()
    # --speculative-draft-window-size: the proposer keeps a sliding window of this many latest draft KV positions
    supports_draft_window: bool = False
    # The error when a required draft (DraftModel.HEAD) has no path: how to get one ("" = the generic message)
    missing_draft: str = ""
    # The target pod plays the draft role (UNO: the target's own layers plus a LoRA on the draft rows): no draft
    # process is started, the target serves DraftService next to TargetService, its `proposer` is then
    # "module:function(engine, args) -> Proposer" over the target engine, and the gateway sends a sequence's Propose
    # to the pod that holds it.
    drafts_on_target: bool = False
    # "module:function(args)": the algorithm's own flag checks and defaults at start-up (torch-free; raises
    # ValueError with the message), run by tandem/args.resolve_spec after the shape is resolved.
    check_flags: str = ""

    @property
    def needs_features(self) -> bool:
        """The target returns hidden states with its results and the gateway forwards them to the draft pod."""
        return self.target_features is not TargetFeatures.NONE

    def proposer_factory(self):
        return _import(self.proposer)

    def flag_checker(self):
        return _import(self.check_flags) if self.check_flags else None

    def resolve_shape(self, architecture: str | None = None, num_steps: int | None = None, topk: int | None = None,
                      num_draft_tokens: int | None = None, *, max_bfs_breadth: int = 10, block_size: int | None = None,
                      draft_block_size: int | None = None) -> tuple[int, int, int]:
        """SGLang's (num_steps, topk, num_draft_tokens) defaults and fix-ups (sglang_spec.md appendix A, §6.1, §7.3).
        block_size: --speculative-dflash-block-size; draft_block_size: the block size of the draft's config."""
        if self.shape_rule is ShapeRule.BLOCK:
            return self._resolve_block(num_steps, topk, num_draft_tokens, block_size, draft_block_size)
        if self.shape_rule is ShapeRule.TRIE:
            # The trie decides the shape: topk is the BFS breadth, num_steps only sizes bookkeeping (SGLang: ndt // topk).
            if max_bfs_breadth < 1:
                raise ValueError(f"max_bfs_breadth must be >= 1, got {max_bfs_breadth}")
            ndt = 12 if num_draft_tokens is None else num_draft_tokens
            _check_positive(num_draft_tokens=ndt)
            if num_steps is not None or topk is not None:
                logger.warning("%s ignores num_steps/topk: topk := max_bfs_breadth, num_steps := ndt // topk",
                               self.name)
            return ndt // max_bfs_breadth, max_bfs_breadth, ndt
        if self.shape_rule is ShapeRule.UNO:
            return uno_shape(num_steps, topk, num_draft_tokens)
        if self.shape_rule is not ShapeRule.BEAM or self.unsupported:
            raise unknown_shape(self.name)
        given = [num_steps is not None, topk is not None, num_draft_tokens is not None]
        if any(given) and not all(given):
            raise ValueError("set all three of num_steps, topk and num_draft_tokens, or none of them")
        if not any(given):
            if architecture in self.tree_default_architectures:
                num_steps, topk, num_draft_tokens = 5, 4, 8
            else:
                num_steps, topk, num_draft_tokens = 3, 1, 4
        _check_positive(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
        if topk == 1 and num_draft_tokens != num_steps + 1:
            logger.warning(
                "topk == 1 builds a chain: num_draft_tokens %d -> num_steps + 1 = %d", num_draft_tokens, num_steps + 1
            )
            num_draft_tokens = num_steps + 1
        capacity = max_tree_candidates(num_steps, topk)
        if num_draft_tokens - 1 > capacity:
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens} needs {num_draft_tokens - 1} draft nodes but "
                f"num_steps={num_steps}, topk={topk} yield only {capacity}"
            )
        return num_steps, topk, num_draft_tokens

    def _resolve_block(self, num_steps: int | None, topk: int | None, num_draft_tokens: int | None,
                       block_size: int | None, draft_block_size: int | None) -> tuple[int, int, int]:
        """SGLang's DFLASH rules: one draft forward per step (steps and topk forced to 1, with a warning);
        num_draft_tokens is the block size: --speculative-dflash-block-size (an alias; both set must match), else
        the draft config's block_size, else 16."""
        if num_steps is not None and num_steps != 1:
            logger.warning("%s only supports speculative_num_steps == 1; overriding speculative_num_steps=%s to 1.",
                           self.name, num_steps)
        if topk is not None and topk != 1:
            logger.warning("%s only supports speculative_eagle_topk == 1; overriding speculative_eagle_topk=%s to 1.",
                           self.name, topk)
        if block_size is not None:
            if block_size <= 0:
                raise ValueError(f"{self.name} requires --speculative-dflash-block-size to be positive, got "
                                 f"{block_size}.")
            if num_draft_tokens is not None and num_draft_tokens != block_size:
                raise ValueError("Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set but "
                                 f"they differ. For {self.name} they must match. speculative_num_draft_tokens="
                                 f"{num_draft_tokens}, speculative_dflash_block_size={block_size}.")
            num_draft_tokens = block_size
        if num_draft_tokens is None:
            num_draft_tokens = draft_block_size
        if num_draft_tokens is None:
            num_draft_tokens = 16
            logger.warning("speculative_num_draft_tokens is not set; defaulting to %d for %s.", num_draft_tokens,
                           self.name)
        _check_positive(num_draft_tokens=num_draft_tokens)
        return 1, 1, num_draft_tokens

    def check_draft_window(self, window_size: int | None, num_draft_tokens: int) -> None:
        """--speculative-draft-window-size (SGLang's rules): positive, >= the block size, and only for algorithms
        whose draft keeps a sliding window here."""
        if window_size is None:
            return
        if not self.supports_draft_window:
            raise ValueError(f"--speculative-draft-window-size: not supported yet for speculative_algorithm="
                             f"{self.name} (the sliding-window draft KV is built for "
                             f"{_or_list(names(lambda a: a.supports_draft_window))})")
        if window_size <= 0:
            raise ValueError(f"--speculative-draft-window-size must be positive, got {window_size}.")
        if window_size < num_draft_tokens:
            raise ValueError("--speculative-draft-window-size must be >= --speculative-num-draft-tokens (block_size). "
                             f"window_size={window_size}, block_size={num_draft_tokens}.")

    def multi_layer_shape(self, enable: bool | None, num_mtp_layers: int, num_steps: int | None = None,
                          topk: int | None = None, num_draft_tokens: int | None = None, *,
                          source: str = "the draft checkpoint") -> tuple[int, int, int] | None:
        """Multi-layer EAGLE (SGLang's --enable-multi-layer-eagle, sglang_spec.md §7.2): draft step s runs MTP layer s
        of a draft checkpoint with `num_mtp_layers` K. enable None = auto: on when K > 1 and the triple, if set, is a
        chain of at most K steps; False = off (layer 0 drafts autoregressively). Returns the chain (steps, 1,
        steps + 1) when on — (K, 1, K + 1) when the triple is unset —, None when off; ValueError for what it refuses."""
        given = [v is not None for v in (num_steps, topk, num_draft_tokens)]
        if enable is None:
            enable = bool(self.mtp_draft) and num_mtp_layers > 1 and (
                not any(given) or all(given) and topk == 1 and num_steps <= num_mtp_layers)
        if not enable:
            return None
        if not self.mtp_draft:
            raise ValueError("--enable-multi-layer-eagle drafts with the MTP layers of a checkpoint: it needs "
                             f"--speculative-algorithm {_or_list(names(lambda a: bool(a.mtp_draft)))}, not "
                             f"speculative_algorithm={self.name}")
        if num_mtp_layers < 1:
            raise ValueError(f"--enable-multi-layer-eagle needs MTP layers (num_nextn_predict_layers) in {source}, "
                             "which has none")
        if not any(given):
            return num_mtp_layers, 1, num_mtp_layers + 1
        if not all(given):
            raise ValueError("set all three of num_steps, topk and num_draft_tokens, or none of them")
        _check_positive(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
        if num_draft_tokens != num_steps + 1:
            raise ValueError("multi-layer EAGLE drafts a chain: speculative_num_draft_tokens must equal "
                             f"speculative_num_steps + 1, got speculative_num_draft_tokens={num_draft_tokens}, "
                             f"speculative_num_steps={num_steps}")
        if topk != 1:
            raise ValueError(f"multi-layer EAGLE drafts a chain: speculative_eagle_topk must be 1, got {topk}")
        if num_steps > num_mtp_layers:
            raise ValueError(f"multi-layer EAGLE runs one MTP layer per draft step: speculative_num_steps={num_steps} "
                             f"exceeds the {num_mtp_layers} MTP layer(s) of {source} (num_nextn_predict_layers)")
        return num_steps, 1, num_draft_tokens


ALGORITHMS: dict[str, SpeculativeAlgorithm] = {}  # name -> entry, in registration order
_BY_NAME: dict[str, SpeculativeAlgorithm] = {}  # name or alias -> entry


def register(algorithm: SpeculativeAlgorithm) -> SpeculativeAlgorithm:
    for name in (algorithm.name, *algorithm.aliases):
        if name in _BY_NAME:
            raise ValueError(f"speculative algorithm {name!r} is registered twice")
    ALGORITHMS[algorithm.name] = algorithm
    for name in (algorithm.name, *algorithm.aliases):
        _BY_NAME[name] = algorithm
    return algorithm


def get(name: str | None) -> SpeculativeAlgorithm:
    """The entry of a name or alias (any case); None or "" = plain decoding. KeyError for a name nobody registered."""
    key = (name or NONE.name).upper()
    if key not in _BY_NAME:
        raise KeyError(f"unknown speculative algorithm {name!r}")
    return _BY_NAME[key]


def find(name: str | None) -> SpeculativeAlgorithm | None:
    try:
        return get(name)
    except KeyError:
        return None


def choices() -> list[str]:
    """Every name and alias the --speculative-algorithm flag accepts: the built ones, then the refused ones."""
    built = [a for a in ALGORITHMS.values() if not a.unsupported]
    refused = [a for a in ALGORITHMS.values() if a.unsupported]
    return [*(a.name for a in built), *(n for a in built for n in a.aliases),
            *(n for a in refused for n in (a.name, *a.aliases))]


def names(where) -> list[str]:
    """Names of the built, non-benchmark algorithms an entry predicate selects, in registration order (messages)."""
    return [a.name for a in ALGORITHMS.values() if not a.unsupported and not a.benchmark_only and where(a)]


def unknown_shape(name: str) -> ValueError:
    """The error for a name that has no draft shape (unknown, plain decoding or not built)."""
    shaped = [n for a in ALGORITHMS.values() if a.shape_rule is not ShapeRule.NONE and not a.unsupported
              and not a.benchmark_only for n in (a.name, *a.aliases)]
    return ValueError(f"unknown speculative algorithm {name!r}; expected {_or_list(sorted(shaped))}")


def uno_shape(num_steps: int | None, topk: int | None, num_draft_tokens: int | None) -> tuple[int, int, int]:
    """UNO's (num_steps, topk, num_draft_tokens) with SGLang's checks and messages (sglang_spec.md §7.4, its
    `_handle_uno`). B/K/V = F (draft forward width) / K (candidate top-k) / V = Q (verify nodes). topk 1 is linear
    mode: F = num_draft_tokens, steps and topk become 1. topk K > 1 is tree mode: F = num_steps + 1 and Q =
    num_draft_tokens. Unset triple: the linear 1/1/4 (SGLang has no default and asks for num_draft_tokens)."""
    if num_steps is None and topk is None and num_draft_tokens is None:
        return 1, 1, 4
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError("UNO requires --speculative-num-draft-tokens to be a positive integer denoting the linear "
                         "width or tree verify width Q.")
    q = num_draft_tokens
    k = 1 if topk is None else topk
    if k < 1:
        raise ValueError(f"UNO requires --speculative-eagle-topk to be at least 1, got {k}.")
    if k == 1:
        if num_steps not in (None, 1):
            logger.warning("UNO uses speculative_num_steps=1; overriding %s.", num_steps)
        return 1, 1, q
    if num_steps is None:
        raise ValueError("UNO tree mode requires --speculative-num-steps so its draft width F can be derived as "
                         "speculative_num_steps + 1.")
    if num_steps < 1:
        raise ValueError(f"UNO tree mode requires --speculative-num-steps to be positive, got {num_steps}.")
    f = num_steps + 1
    if q < f:
        raise ValueError(f"UNO tree mode requires Q >= F; got Q={q}, F={f}.")
    if q > 128:
        raise ValueError(f"UNO tree mode currently supports at most Q=128 verify nodes, got Q={q}.")
    if q * k > 2048:
        raise ValueError(f"UNO tree mode currently supports Q*K <= 2048; got Q*K={q}*{k}={q * k}.")
    capacity, width = 1, 1
    for _ in range(num_steps):
        width *= k
        capacity += width
        if capacity >= q:
            break
    if q > capacity:
        raise ValueError(f"UNO tree mode cannot build the requested Q from F and K: Q={q} exceeds "
                         f"capacity={capacity} for F={f}, K={k}.")
    parent_width = k * max(num_steps - 1, 0) + 1
    if q - 1 > parent_width:
        raise ValueError(f"UNO tree mode cannot represent the requested Q in EAGLE's parent-list ABI: Q-1={q - 1} "
                         f"exceeds K*(F-2)+1={parent_width} for F={f}, K={k}.")
    return num_steps, k, q


def max_tree_candidates(num_steps: int, topk: int) -> int:
    """Number of candidates a beam expansion produces: k at level 1, k*k at every later level."""
    return topk + (num_steps - 1) * topk * topk


def _import(target: str):
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _or_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


# ---------------------------------------------------------------- the entries
# SGLang's EAGLE-family defaults: a 5/4/8 tree on these targets, the 3/1/4 chain elsewhere (appendix A).
_TREE_TARGETS = ("LlamaForCausalLM", "Grok1ForCausalLM")

NONE = register(SpeculativeAlgorithm("NONE", drafts=False, shape_rule=ShapeRule.NONE))

register(SpeculativeAlgorithm(
    "STANDALONE", supports_overlap=True, supports_adaptive=True, draft_model=DraftModel.CHECKPOINT,
    bundled_draft="tandem-demo-code-draft", proposer="draft_service.standalone:build"))

register(SpeculativeAlgorithm(
    "NGRAM", shape_rule=ShapeRule.TRIE, proposer="draft_service.ngram_draft:build", flags=(
        AlgorithmFlag("--speculative-ngram-min-bfs-breadth", "NGRAM: min BFS breadth", int, 1),
        AlgorithmFlag("--speculative-ngram-max-bfs-breadth", "NGRAM: max BFS breadth", int, 10),
        AlgorithmFlag("--speculative-ngram-match-type", "NGRAM: BFS (recency) or PROB (frequency) tree construction",
                      str, "BFS", ("BFS", "PROB")),
        AlgorithmFlag("--speculative-ngram-max-trie-depth", "NGRAM: max trie depth", int, 18),
        AlgorithmFlag("--speculative-ngram-capacity", "NGRAM: trie node capacity", int, 10_000_000),
        AlgorithmFlag("--speculative-ngram-external-corpus-path", "NGRAM: a JSONL corpus (one JSON string, a "
                      "document's text, per line) indexed at start-up and drafted from beside the trie; more at run "
                      "time with POST /add_external_corpus"),
        AlgorithmFlag("--speculative-ngram-external-sam-budget", "NGRAM: draft tree nodes given to the external "
                      "corpora (split evenly; 0: the corpora draft nothing)", int, 0),
        AlgorithmFlag("--speculative-ngram-external-corpus-max-tokens", "NGRAM: tokens all external corpora may hold",
                      int, 10_000_000),
    )))

register(SpeculativeAlgorithm(
    "EAGLE", target_features=TargetFeatures.FINAL_HIDDEN, tree_default_architectures=_TREE_TARGETS,
    supports_adaptive=True, supports_overlap=True, supports_rejection_sampling=True, draft_model=DraftModel.HEAD,
    token_map_ignored=None, mtp_draft="default",
    proposer="draft_service.eagle:build"))

register(SpeculativeAlgorithm(
    "EAGLE3", target_features=TargetFeatures.AUX_LAYERS, tree_default_architectures=_TREE_TARGETS,
    supports_adaptive=True, supports_overlap=True, supports_rejection_sampling=True, draft_model=DraftModel.HEAD,
    bundled_draft="tandem-demo-code-eagle3",
    token_map_ignored="an EAGLE-3 head carries its own d2t map", proposer="draft_service.eagle:build"))

# MTP / NextN (DeepSeek-V3 layout; MiMo, GLM, Qwen3-Next): the target's own MTP layers draft, fed the target's
# final hidden states (runtime/models/mtp.py); the bundled target carries one. On a checkpoint without MTP layers it
# drafts with an EAGLE-2 head (--speculative-draft-model-path), as SGLang's NEXTN does.
register(SpeculativeAlgorithm(
    "NEXTN", target_features=TargetFeatures.FINAL_HIDDEN, tree_default_architectures=_TREE_TARGETS,
    supports_adaptive=True, supports_overlap=True, supports_rejection_sampling=True, draft_model=DraftModel.HEAD,
    token_map_ignored=None, mtp_draft="always",
    proposer="draft_service.eagle:build"))

# Synthetic acceptance (draft_service/synthetic.py), benchmarks only: an oracle continuation corrupted at a set rate,
# spending an EAGLE-3-sized head's compute; it takes an EAGLE-3 head's shapes.
register(SpeculativeAlgorithm(
    "SYNTHETIC", benchmark_only=True, tree_default_architectures=_TREE_TARGETS, supports_adaptive=True,
    supports_overlap=True,
    draft_model=DraftModel.BUILT_IN, proposer="draft_service.synthetic:build", flags=(
        AlgorithmFlag("--synthetic-oracle", "SYNTHETIC (synthetic acceptance, benchmarks only): JSON of each prompt's "
                      "target greedy continuation, written by bench/speculative.py's reference AR run"),
        AlgorithmFlag("--synthetic-accept-rate", "SYNTHETIC: probability that each oracle token is kept in the draft "
                      "(expected accept length of depth D: sum_{i=0..D} a^i)", float, 0.8),
        AlgorithmFlag("--synthetic-head-hidden", "SYNTHETIC: hidden size of the random EAGLE-3-sized head whose compute "
                      "is spent per step (default: the target's; 0 = no head compute)", int),
        AlgorithmFlag("--synthetic-draft-vocab", "SYNTHETIC: lm_head rows of that head", int, 32000),
        AlgorithmFlag("--synthetic-margin-weights", "SYNTHETIC, target with --load-format dummy: structured dummy "
                      "weights whose greedy argmax wins by tens of logits (runtime/models/loader.widen_dummy_margins), "
                      "so the oracle survives bf16 rounding differences between verify and decode (bench/speculative.py "
                      "--mode services)", None, forward=False),
    )))

# UNO (sglang_spec.md §7.4): no draft model; the target drafts with its own layers plus a LoRA applied to the draft
# rows only (runtime/lora.py), inside the target pod (target_service/uno.py). The bundled adapter fits the bundled
# target.
register(SpeculativeAlgorithm(
    "UNO", shape_rule=ShapeRule.UNO, bundled_draft="tandem-demo-code-uno", drafts_on_target=True,
    token_map_ignored="UNO drafts with the target's own vocabulary", proposer="target_service.uno:build",
    check_flags="tandem.uno_flags:check", flags=(
        AlgorithmFlag("--uno-lora-path", "UNO: PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) "
                      "applied to the target's layers on the draft rows only (default: $UNO_LORA_PATH, else the "
                      "bundled tandem-demo-code-uno for the bundled target)"),
    )))

# SGLang's algorithms Tandem does not run yet: parsed, then refused at start-up (tandem/compat.py).
# DFLASH (block diffusion, runtime/models/dflash.py): the target returns the hidden states of the draft's configured
# layers; the draft drafts a whole block [bonus, MASK x (B-1)] in one forward; verify is a causal chain.
register(SpeculativeAlgorithm(
    "DFLASH", target_features=TargetFeatures.BLOCK_FEATURES, shape_rule=ShapeRule.BLOCK, tree=False,
    draft_model=DraftModel.HEAD, proposer="draft_service.dflash:build", supports_draft_window=True,
    bundled_draft="tandem-demo-code-dflash",
    missing_draft="DFLASH speculative decoding requires setting --speculative-draft-model-path. Train a DFlash draft "
                  "for this target with: python -m tools.train_draft --kind dflash --target-model-path TARGET "
                  "--corpus CORPUS --output-dir DRAFT",
    flags=(
        AlgorithmFlag("--speculative-dflash-block-size", "DFLASH: block size (tokens per draft block, the bonus "
                      "token included); an alias of --speculative-num-draft-tokens, both set must match (default: "
                      "the draft config's block_size, else 16)", int, forward=False),
        AlgorithmFlag("--speculative-draft-window-size", "DFLASH: the draft attends to at most this many latest "
                      "context tokens, in a compact sliding-window draft KV of that many slots per sequence; must "
                      "be >= the block size (default: the whole context)", int,
                      aliases=("--speculative-dflash-draft-window-size",)),
    )))
register(SpeculativeAlgorithm("DSPARK", tree=False,
                              unsupported="DSPARK (block drafts with ragged verify) is not supported yet"))
