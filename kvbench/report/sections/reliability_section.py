"""The reliability section: what mutated streams did to each compressor's decoder, from the runs
scripts/reliability.py files out of the fuzz tests' tally (one per compressor and variant, one row per mutation).

Per compressor: the frame mutations its frame refused (they reach no decoder), the distinct section mutations that
reached the decoder behind a valid frame, and what became of those: rejected (by the error's type), decoded as the
original, or decoded to another cache without an error, beside whether the format carries a content check (the
compressor class's ``content_check``: only a format without one may do the last). Per mutation: the same over every
compressor."""

from __future__ import annotations

import pandas as pd

from kvbench.report.collect import Collection, numeric
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

CASE_COLUMNS = pick("case", "content_check", "frame_mutations", "frame_rejected", "reached_decoder",
                    "rejected_bitstream_error", "rejected_value_error", "decoded_identical", "decoded_differently",
                    "differently_share", "known_limit", "failures", "tests_passed", "tests_s")
MUTATION_COLUMNS = pick("mutation_class", "mutation", "mutation_n", "mutation_rejected", "mutation_identical",
                        "mutation_differently", "mutation_failures")
COUNTS = [c.key for c in MUTATION_COLUMNS[2:]]
CASE_NOTE = ("Frame mutations (bits flipped in the stored bytes, the stream truncated or extended) are refused by the "
             "frame's checksum and length checks before any decoder runs. Reached the decoder: distinct section "
             "mutations behind a rebuilt, valid frame, each decoded once; every one is rejected with an error, "
             "decoded as the original, or decoded to another cache of the declared shapes without an error, which "
             "only a format without a content check may do (and, for a mutation of a section's length, only as the "
             "known limit). Variants after a slash are other coders behind the same config. Tests s: the seconds of "
             "the compressor's two fuzz tests, its case built and fitted in the first.")
MUTATION_NOTE = ("Summed over every compressor. frame: the stored bytes; structure: what a section holds as a whole "
                 "(truncated, extended, dropped, added, renamed, a header integer re-encoded longer or shorter); "
                 "payload: values changed in place (bits flipped, bytes overwritten, two sections swapped, a header "
                 "integer changed in place); nested:OP is OP inside a stream embedded in a section, its frame "
                 "rebuilt too.")


def per_case(d: pd.DataFrame) -> pd.DataFrame:
    """One row per compressor and variant, with the share of the mutations reaching its decoder that decoded to
    another cache."""
    cases = d.drop_duplicates("run_id").sort_values("case", kind="stable").reset_index(drop=True)
    return cases.assign(differently_share=numeric(cases, "decoded_differently") / numeric(cases, "reached_decoder"))


def per_mutation(d: pd.DataFrame) -> pd.DataFrame:
    """One row per mutation, its counts summed over every compressor."""
    counts = d.assign(**{c: numeric(d, c) for c in COUNTS})
    return counts.groupby(["mutation_class", "mutation"], sort=True)[COUNTS].sum().reset_index()


def reliability(got: Collection) -> tuple[list[Table], Figures]:
    d = got.reliability
    cases = per_case(d) if not d.empty else d
    mutations = per_mutation(d) if not d.empty else d
    return [Table("reliability", cases, CASE_COLUMNS, "per compressor", CASE_NOTE, empty="_no reliability runs_\n",
                  csv=True),
            Table("reliability", mutations, MUTATION_COLUMNS, "per mutation", MUTATION_NOTE)], {}
