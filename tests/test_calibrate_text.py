"""The text `hack calibrate` measures on: held out of every evaluation (the accuracy study's plays,
the fidelity prompts' and workloads' ShareGPT conversations), built into seeded items whose needle
and answer sit where the item says, one kind of text after another for the default mix."""
from __future__ import annotations

import pytest

from hack_eval.calibration_text import (CHAT_FIRST, HELD_OUT_PLAYS, CalibrationText, build_items, chats,
                                        held_out_plays, item_sources)
from hack_eval.models import prepare


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(prepare(log=lambda m: None)))


def test_the_accuracy_study_never_reads_the_held_out_plays(tok):
    from hack_eval.texts import play_files, token_windows

    files = play_files()
    held = held_out_plays()
    assert len(held) == HELD_OUT_PLAYS and held == files[-HELD_OUT_PLAYS:]
    # the most windows any documented study takes (6 plays at 8K), and more: the same windows
    # come from the plays before the held-out ones, so no window is cut from them
    for length, count in ((8192, 8), (2048, 8)):
        assert token_windows(tok, files, length, count, skip_chars=4000) == \
            token_windows(tok, files[:-HELD_OUT_PLAYS], length, count, skip_chars=4000)


def test_the_chat_text_is_none_of_the_workloads_or_fidelity_conversations():
    from hack_eval.workloads import sharegpt_pairs

    # the fidelity prompts' pool (and every workload's), as (first turn, first reply): ShareGPT repeats
    # some first turns word for word in other conversations
    firsts = set(sharegpt_pairs(4000))
    bodies = chats(limit=40)
    assert len(bodies) == 40 and CHAT_FIRST > 4000
    for body in bodies:
        assert body.startswith("User: ") or body.startswith("Assistant: ")
        turns = body.split("\n\nAssistant: ", 1)
        if len(turns) == 2 and turns[0].startswith("User: "):
            reply = turns[1].split("\n\nUser: ", 1)[0]
            assert (turns[0].removeprefix("User: "), reply) not in firsts


def test_the_mix_takes_each_kind_in_turn():
    assert item_sources("mix", 4) == [CalibrationText.PLAYS, CalibrationText.CHAT, CalibrationText.GSM8K,
                                      CalibrationText.PLAYS]
    assert item_sources(CalibrationText.GSM8K, 2) == [CalibrationText.GSM8K] * 2
    with pytest.raises(ValueError):
        item_sources("wiki", 1)


def test_items_hold_their_needle_and_answer(tok):
    items = build_items(tok, 512, 4, seed=1)
    assert [it.source for it in items] == item_sources("mix", 4)
    for it in items:
        assert len(it.ids) == 512
        answer = tok.decode(list(it.ids[it.answer_start:])).strip()
        assert len(answer) == 5 and answer.isdigit()
        needle = tok.decode(list(it.ids[it.needle_start:it.needle_start + it.needle_len]))
        assert needle.strip() == f"Note: the access code is {answer}. Keep it: the access code is {answer}."
        assert tok.decode(list(it.ids[:it.answer_start])).endswith("The access code is")
    # the two plays items read different stretches; the haystacks differ by kind
    assert items[0].ids[40:120] != items[3].ids[40:120]
    assert len({it.ids[40:120] for it in items}) == 4
    assert build_items(tok, 512, 4, seed=1) == items  # seeded
    gsm = build_items(tok, 512, 1, seed=1, text="gsm8k")[0]
    assert "Question:" in tok.decode(list(gsm.ids)) and gsm.source == CalibrationText.GSM8K
    with pytest.raises(ValueError):
        build_items(tok, 100, 1)


def test_without_the_gsm8k_file_only_its_items_are_refused(tok, monkeypatch, tmp_path):
    """Where the GSM8K file is missing, a mix that needs it stops before any measurement, naming the
    path; plays and chat items need nothing outside the packages, and a plan's description does not
    read the file."""
    from hack_eval.calibration_text import ENV_VAR, describe

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "absent.jsonl"))
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        build_items(tok, 512, 3)
    assert [it.source for it in build_items(tok, 512, 2)] == [CalibrationText.PLAYS, CalibrationText.CHAT]
    assert "absent.jsonl" in describe("mix")
