"""LEMON benchmark data, answer extraction and scoring.

Six benchmarks (:data:`BENCHMARKS`): GSM8K, MultiArith, SVAMP, AQuA (math), MMLU
(knowledge) and HumanEval (code). See :mod:`.data` (loading), :mod:`.answers`
(extraction/normalisation), :mod:`.humaneval` (sandboxed code scoring),
:mod:`.registry` (:class:`Benchmark`), :mod:`.pools` (disjoint train/eval pools) and
:mod:`.records` (one :class:`BenchmarkRecord` per benchmark, from which every table is derived).
"""

from .answers import (canonical_number, extract_letter, extract_number, normalize_text,
                      numbers_match, parse_number)
from .data import (BENCHMARKS, HUB_IDS, SPLITS, Example, FrozenMeta, available_splits,
                   clear_cache, default_data_dir, load, resolve_data_dir)
from .errors import DataNotFoundError, UnknownBenchmarkError, UnknownSplitError
from .humaneval import build_program, build_solution, extract_code
from .pools import (PROTOCOLS, POOL_SPLITS, dropped_counts, dropped_examples, eval_pool,
                    humaneval_train_ids, normalize_question, pool, train_pool)
from .records import RECORDS, BenchmarkRecord
from .registry import REGISTRY, Benchmark, extract_answer, get_benchmark, score

__all__ = [
    "BENCHMARKS", "Benchmark", "BenchmarkRecord", "RECORDS", "DataNotFoundError", "Example", "FrozenMeta", "HUB_IDS",
    "POOL_SPLITS", "PROTOCOLS", "REGISTRY", "SPLITS", "UnknownBenchmarkError",
    "UnknownSplitError", "available_splits", "build_program", "build_solution",
    "canonical_number", "clear_cache", "default_data_dir", "dropped_counts",
    "dropped_examples", "eval_pool", "extract_answer", "extract_code", "extract_letter",
    "extract_number", "get_benchmark", "humaneval_train_ids", "load", "normalize_question",
    "normalize_text", "numbers_match", "parse_number", "pool", "resolve_data_dir", "score",
    "train_pool",
]
