"""Loaders on small local files (GSM8K, MATH, Countdown schemas, custom mapping), generators, prompt text, held-out splits."""

import itertools
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from grpo.foundation.config import ArithmeticTaskConfig, ConfigError, CountdownTaskConfig, DataConfig
from grpo.training.configure import load_config
from grpo.data.sources import PromptDataset, load_eval_source, load_source, prompt_ids, prompt_text
from grpo.data.tasks import R1_SYSTEM_PROMPT, ArithmeticTask, CountdownTask
from grpo.foundation.tiny import make_char_tokenizer
from rewards.math_answer import math_correct

# The first 40 lines of GSM8K's train split (../shared/data/gsm8k/train.jsonl), with its MIT licence.
GSM8K_HEAD = Path(__file__).resolve().parent / "data" / "gsm8k" / "train_head40.jsonl"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def data(**kw):
    return DataConfig(**kw)


GSM_ROWS = [
    {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
    {"question": "A box holds 1,200 pens. 200 are sold. How many are left?", "answer": "#### 1,000"},
    {"question": "What is 6 times 7?", "answer": "6*7=42\n#### 42"},
]


def test_gsm8k_schema(tmp_path):
    cfg = data(source="jsonl", path=write_jsonl(tmp_path / "g.jsonl", GSM_ROWS), task="gsm8k")
    src = load_source(cfg, seed=0)
    assert len(src) == 3
    item = src[1]
    assert item["prompt"] == GSM_ROWS[1]["question"] and item["answer"] == GSM_ROWS[1]["answer"]
    assert math_correct([item["prompt"]], ["<answer>1000</answer>"], [item["answer"]], gold="gsm8k") == [1.0]


def test_math_schema_with_boxed_solutions(tmp_path):
    rows = [{"problem": "Solve x+1=3.", "solution": "So $x=\\boxed{2}$.", "level": "Level 1"}]
    src = load_source(data(source="jsonl", path=write_jsonl(tmp_path / "m.jsonl", rows), task="math"), 0)
    item = src[0]
    assert item["prompt"] == "Solve x+1=3." and item["level"] == "Level 1"  # other columns pass through
    assert math_correct(["p"], ["\\boxed{2}"], [item["answer"]], extract="boxed") == [1.0]


def test_countdown_schema_and_template(tmp_path):
    rows = [{"target": 22, "nums": [3, 5, 7]}, {"target": 4, "nums": [5, 7, 3, 1]}]
    src = load_source(data(source="jsonl", path=write_jsonl(tmp_path / "c.jsonl", rows), task="countdown"), 0)
    item = src[0]
    assert item["nums"] == [3, 5, 7] and item["target"] == 22
    assert "Using the numbers [3, 5, 7], create an equation that equals 22" in item["prompt"]


def test_the_countdown_generator_takes_tinyzeros_prompt_by_itself():
    """data.source=countdown as docs/data.md gives it (no data.task): the generated rows get TinyZero's prompt (it
    stopped at start: "the items have no 'prompt' column"); a prompt_template of one's own still wins."""
    src = load_source(data(source="countdown", countdown=CountdownTaskConfig(num_examples=3)), 0)
    assert src[0]["prompt"].startswith(f"Using the numbers {src[0]['nums']}, create an equation that equals "
                                       f"{src[0]['target']}.")
    own = load_source(data(source="countdown", countdown=CountdownTaskConfig(num_examples=3),
                           prompt_template="{target} from {nums}"), 0)
    assert own[0]["prompt"] == f"{own[0]['target']} from {own[0]['nums']}"


def test_parquet_with_custom_column_mapping_and_template(tmp_path):
    import pandas as pd

    path = tmp_path / "t.parquet"
    pd.DataFrame({"q": ["2+2?", "3+3?"], "gold": ["4", "6"], "src": ["a", "b"]}).to_parquet(path)
    cfg = data(source="parquet", path=str(path), columns={"question": "q", "answer": "gold"},
               prompt_template="Question: {question} (from {src})")
    item = load_source(cfg, 0)[1]
    # issue 42, item 20: a mapping adds our name and keeps the dataset's (a TRL reward may read either)
    assert item == {"q": "3+3?", "gold": "6", "src": "b", "question": "3+3?", "answer": "6",
                    "prompt": "Question: 3+3? (from b)"}


def test_missing_column_stops_with_its_name(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "solution": "#### 1"}])
    with pytest.raises(ConfigError, match=r"data.columns.answer='answer'.*no column 'answer'.*\['question', 'solution'\]"):
        load_source(data(source="jsonl", path=path, task="gsm8k"), 0)
    with pytest.raises(ConfigError, match="data.columns.prompt='prompt'.*no column 'prompt'"):
        load_source(data(source="jsonl", path=path, columns={"answer": "solution"}), 0)
    rows = write_jsonl(tmp_path / "c.jsonl", [{"nums": [1, 2], "target": 3}])  # Countdown's rows without data.task
    with pytest.raises(ConfigError, match=r"no column 'prompt'; its columns are \['nums', 'target'\]"):
        load_source(data(source="jsonl", path=rows), 0)


def test_template_naming_a_missing_column_stops_with_its_name(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ConfigError, match=r"names the column 'topic'.*\['prompt'\]"):
        load_source(data(source="jsonl", path=path, prompt_template="{topic}: {prompt}"), 0)


def test_template_fields_a_row_cannot_give_stop_with_the_row(tmp_path):
    """An index past a row's list, an attribute its value lacks, an index into a number, a width past memory: a
    ConfigError naming the template and the row (they were an IndexError taken for a bad format string, or an
    AttributeError, TypeError or MemoryError from the depths)."""
    from grpo.data.sources import PromptDataset

    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "hi", "nums": [1, 2, 3], "n": 4}, {"prompt": "yo", "nums": [1]}])
    for template, row, error in (("{nums[2]}: {prompt}", 1, "IndexError"), ("{prompt.x}", 0, "AttributeError"),
                                 ("{n[0]}", 0, "TypeError"), ("{prompt:>99999999999999}", 0, "(Overflow|Memory)Error")):
        with pytest.raises(ConfigError, match=rf"data.prompt_template='{re.escape(template)}' cannot be filled from "
                                              rf"row {row} \({error}: .*'prompt': '(hi|yo)'"):
            PromptDataset.build(load_source(data(source="jsonl", path=path, prompt_template=template), 0),
                                make_char_tokenizer(), data(), max_prompt_length=50)


def test_empty_dataset_stops_with_a_message(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl.*holds no rows"):
        load_source(data(source="jsonl", path=str(path), task="gsm8k"), 0)
    import pandas as pd

    pq = tmp_path / "empty.parquet"
    pd.DataFrame({"question": [], "answer": []}).to_parquet(pq)
    with pytest.raises(ConfigError, match="empty.parquet.*holds no rows"):
        load_source(data(source="parquet", path=str(pq), task="gsm8k"), 0)


def test_missing_file_stops_with_its_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.jsonl"):
        load_source(data(source="jsonl", path=str(tmp_path / "nope.jsonl")), 0)


# --------------------------------------------------------------------------- generators


def solvable(nums, target):
    """Brute force: some order, operators and bracketing of all numbers reaches the target."""
    def values(xs):
        if len(xs) == 1:
            yield Fraction(xs[0])
            return
        for k in range(1, len(xs)):
            for a in values(xs[:k]):
                for b in values(xs[k:]):
                    yield from (a + b, a - b, a * b)
                    if b:
                        yield a / b
    return any(v == target for p in itertools.permutations(nums) for v in values(list(p)))


def test_countdown_generator_is_seeded_and_solvable():
    cfg = CountdownTaskConfig(num_examples=15, min_numbers=3, max_numbers=4, max_number=20, max_target=200)
    a, b = CountdownTask(cfg, seed=3), CountdownTask(cfg, seed=3)
    assert [a[i] for i in range(15)] == [b[i] for i in range(15)]
    assert [a[i] for i in range(15)] != [CountdownTask(cfg, seed=4)[i] for i in range(15)]
    for i in range(15):
        item = a[i]
        assert 3 <= len(item["nums"]) <= 4 and all(1 <= n <= 20 for n in item["nums"])
        assert 1 <= item["target"] <= 200 and solvable(item["nums"], item["target"])


def test_arithmetic_generator():
    task = ArithmeticTask(ArithmeticTaskConfig(num_examples=200, max_value=12), seed=0)
    assert len(task) == 200
    for i in range(200):
        item = task[i]
        assert item["prompt"].endswith("?") and int(item["answer"]) >= 0
    assert task[0] == ArithmeticTask(ArithmeticTaskConfig(num_examples=1, max_value=12), seed=0)[0]


# --------------------------------------------------------------------------- prompt text


def test_chat_template_with_r1_system_prompt_and_prefill():
    tok = make_char_tokenizer()
    cfg = data(chat_template=True, system_prompt="r1", prefill="<think>")
    text = prompt_text(tok, {"prompt": "2+2?"}, cfg)
    assert text == f"s:{R1_SYSTEM_PROMPT}\nu:2+2?\na:<think>"
    assert tok.decode(prompt_ids(tok, {"prompt": "2+2?"}, cfg)) == text


def test_a_chat_template_asked_of_a_tokenizer_without_one_names_the_fix():
    """A base model's tokenizer has no chat template: transformers' ValueError from inside the dataset, before."""
    tok = make_char_tokenizer()
    tok.chat_template = None
    for cfg, prompt, why in ((data(), [{"role": "user", "content": "hi"}], "the prompts are chat messages"),
                             (data(chat_template=True), "hi", "data.chat_template=True")):
        with pytest.raises(ConfigError, match=rf"{why}, and the tokenizer of .* has no chat template .*data.chat_"
                                              rf"template=false"):
            PromptDataset.build([{"prompt": prompt}], tok, cfg, max_prompt_length=50)
    from grpo.rollout.multiturn import ChatRenderer

    with pytest.raises(ConfigError, match=r"multi-turn rollouts need a tokenizer with a chat template .* give one with "
                                          r"data.chat_template"):
        ChatRenderer(tok, [tok.eos_token_id])


def test_a_template_of_its_own_renders_plain_text_prompts_too(tmp_path):
    """data.chat_template given as a template (or its file) with plain-text prompts: the dataset holds each prompt's
    templated ids (it crashed at start: the batched encoding was keyed on data.chat_template being exactly true)."""
    from grpo.training import build

    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}={% endif %}"
    (tmp_path / "t.jinja").write_text(template)
    for value in (template, str(tmp_path / "t.jinja")):
        tok, ds, _ = build.data(load_config(overrides=[f"data.chat_template={value}"]), None)
        assert [tok.decode(ids) for ids in ds.ids[:3]] == [f"<{it['prompt']}>=" for it in ds.items[:3]]


# Qwen3's way: the generation prompt holds an empty think block when enable_thinking is false
THINKING = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
            "a:{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template():
    """data.chat_template_kwargs (TRL's chat_template_kwargs): the template is rendered with them, in the prompts and
    in a multi-turn rollout's turns alike."""
    from grpo.rollout.multiturn import ChatRenderer

    tok = make_char_tokenizer()
    tok.chat_template = THINKING
    off = data(chat_template=True, chat_template_kwargs={"enable_thinking": False})
    assert prompt_text(tok, {"prompt": "2+2?"}, off) == "u:2+2?\na:<think></think>"
    assert prompt_text(tok, {"prompt": "2+2?"}, data(chat_template=True)) == "u:2+2?\na:"
    assert tok.decode(prompt_ids(tok, {"prompt": "2+2?"}, off)) == "u:2+2?\na:<think></think>"
    render = ChatRenderer(tok, [tok.eos_token_id], template_kwargs={"enable_thinking": False})
    assert tok.decode(render.first([{"role": "user", "content": "hi"}])) == "u:hi\na:<think></think>"
    assert tok.decode(render.later([{"role": "user", "content": "ok"}], True)).endswith("u:ok\na:<think></think>")


def test_chat_template_kwargs_the_template_does_not_read_or_no_prompt_uses_are_refused():
    """A key that would change nothing stops the run with what the template reads, before any model loads."""
    from grpo.data.sources import check_template_kwargs, template_variables

    tok = make_char_tokenizer()
    tok.chat_template = THINKING
    assert template_variables(THINKING) == ["add_generation_prompt", "enable_thinking", "messages"]
    check_template_kwargs(tok, data(chat_template=True, chat_template_kwargs={"enable_thinking": False}), used=True)
    misspelt = data(chat_template=True, chat_template_kwargs={"enable_thinkng": False})
    with pytest.raises(ConfigError, match=r"never reads \['enable_thinkng'\].*besides the messages and special "
                                          r"tokens: \['enable_thinking'\]"):
        check_template_kwargs(tok, misspelt, used=True)
    with pytest.raises(ConfigError, match=r"no prompt goes through the chat template.*data.chat_template=true"):
        check_template_kwargs(tok, data(chat_template_kwargs={"enable_thinking": False}), used=False)
    tok.chat_template = None
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        check_template_kwargs(tok, data(chat_template=True, chat_template_kwargs={"enable_thinking": False}), used=True)
    check_template_kwargs(tok, data(), used=False)  # none set: nothing to check


def test_chat_template_kwargs_from_the_command_line_and_the_checks_at_start():
    """`data.chat_template_kwargs.enable_thinking=false` is a bool; apply_chat_template's own arguments are refused
    when the config loads; the trainer's data set-up (grpo.training.build.data) checks the keys against the template."""
    from grpo.training import build

    cfg = load_config(overrides=["data.chat_template_kwargs.enable_thinking=false",
                                 f"data.chat_template={THINKING}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    tok, ds, _ = build.data(cfg, None)
    assert tok.decode(ds.ids[0]).endswith("a:<think></think>")
    cfg.data.chat_template_kwargs = {"thinking": False}
    with pytest.raises(ConfigError, match=r"never reads \['thinking'\]"):
        build.data(cfg, None)
    cfg.data.chat_template = False  # plain-text prompts: nothing would read them
    with pytest.raises(ConfigError, match=r"no prompt goes through the chat template"):
        build.data(cfg, None)
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs sets \['add_generation_prompt'\]"):
        load_config(overrides=["data.chat_template_kwargs={add_generation_prompt: false}"])
    with pytest.raises(ConfigError, match=r"'chat_template_kwargs' is TRL's name .* data.chat_template_kwargs"):
        load_config(tree={"chat_template_kwargs": {"enable_thinking": False}})


def test_dataset_ids_are_each_prompts_own_encoding(monkeypatch):
    """The dataset tokenizes in batches (grpo.data.sources.encode_texts): each prompt's ids equal its own
    encoding, BOS added to plain text and not to a rendered chat template, across batch boundaries."""
    from tokenizers import processors

    import grpo.data.sources as sources

    tok = make_char_tokenizer()
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    monkeypatch.setattr(sources, "ENCODE_BATCH", 3)
    items = [{"prompt": [{"role": "user", "content": f"{i}+1?"}]} if i % 3 == 0 else {"prompt": f"q{i}?" * (i % 4 + 1)}
             for i in range(11)]
    cfg = data(system_prompt="Hi")
    ds = PromptDataset.build(items, tok, cfg, max_prompt_length=14)
    assert ds.ids == [prompt_ids(tok, item, cfg) for item in ds.items] and ds.dropped > 0
    assert any(isinstance(it["prompt"], list) for it in ds.items)  # chat prompts kept too
    assert sum(ids[0] == bos for ids in ds.ids) == sum(isinstance(it["prompt"], str) for it in ds.items) > 0


def test_plain_text_prompt_for_base_models():
    tok = make_char_tokenizer()
    cfg = data(system_prompt="Be brief.", prefill="A:")
    assert prompt_text(tok, {"prompt": "Q: 2+2?\n"}, cfg) == "Be brief.\nQ: 2+2?\nA:"


def test_over_long_prompts_are_dropped_and_counted():
    tok = make_char_tokenizer()
    items = [{"prompt": "x" * n} for n in (5, 50, 8, 60)]
    ds = PromptDataset.build(items, tok, data(), max_prompt_length=10)
    assert len(ds) == 2 and ds.dropped == 2
    with pytest.raises(ConfigError, match="every prompt is longer"):
        PromptDataset.build(items[1::2], tok, data(), max_prompt_length=10)


def test_null_empty_and_non_text_prompts_are_left_out_and_counted():
    """Issue 30, item 14: an empty prompt was kept (a generation of only it crashed the run, batched with
    others it was sampled from padding), a null one became the text "None"."""
    tok = make_char_tokenizer()
    items = [{"prompt": "ok"}, {"prompt": ""}, {"prompt": None}, {"prompt": "  \n"}, {"prompt": 7}, {"prompt": []},
             {"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": "fine"}]
    ds = PromptDataset.build(items, tok, data(), max_prompt_length=50)
    assert [it["prompt"] for it in ds.items] == ["ok", [{"role": "user", "content": "hi"}], "fine"]
    assert ds.unusable == {"empty": 3, "null": 1, "not text": 1} and ds.dropped == 0
    with pytest.raises(ConfigError, match=r"no usable prompt: 3 prompts left out \(empty 2, null 1\)"):
        PromptDataset.build(items[1:4], tok, data(), max_prompt_length=50)


def test_a_huge_prompt_is_dropped_without_being_tokenized():
    """Issue 30, item 25: an 8 MiB row was tokenized whole (~10 s, 1.3 GB) before the length check."""
    tok = make_char_tokenizer()
    seen = []
    real = type(tok).__call__
    tok.__class__ = type("Counting", (type(tok),), {"__call__": lambda self, text, *a, **k: seen.append(len(text))
                                                   or real(self, text, *a, **k)})
    ds = PromptDataset.build([{"prompt": "ok"}, {"prompt": "x" * 2_000_000}], tok, data(), max_prompt_length=10)
    assert len(ds) == 1 and ds.dropped == 1 and max(seen) < 1000


def test_chat_messages_without_a_role_name_the_file_and_the_row():
    """Issue 30, item 28: a raw library error before."""
    tok = make_char_tokenizer()
    items = [{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"content": "no role"}]}]
    with pytest.raises(ConfigError, match=r"data.path='d.jsonl', row 1: prompt message 0 is .*no role.* 'role'"):
        PromptDataset.build(items, tok, data(path="d.jsonl"), max_prompt_length=50)


def test_a_row_that_is_not_utf8_names_the_file_and_the_row(tmp_path):
    """Issue 30, item 28: pyarrow's raw UnicodeDecodeError, naming neither, before."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    src = load_source(data(source="jsonl", path=str(path)), 0)
    assert src[0]["prompt"] == "a"
    with pytest.raises(ConfigError, match=r"latin1.jsonl', row 1: its text is not UTF-8 .*iconv -f latin1 -t utf-8"):
        src[1]


@pytest.mark.parametrize("first", ["null", "7", '"text"', "true"])
def test_a_first_line_that_is_not_an_object_names_the_line(tmp_path, first):
    """A JSON Lines file whose first row is null killed the process in pyarrow's reader (a segmentation fault,
    pyarrow 26); a number, a text or a boolean there was pyarrow's "Column() changed from object to ...". Plain or
    compressed, held-out data alike."""
    import gzip

    text = f"\n{first}\n" + '{"prompt": "a"}\n'
    plain, packed = tmp_path / "rows.jsonl", tmp_path / "rows.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    for path in (plain, packed):
        with pytest.raises(ConfigError, match=rf"{path.name}', line 2 is {re.escape(first)}, not a JSON object: each "
                                              rf"line of a JSON Lines file is one row"):
            load_source(data(source="jsonl", path=str(path)), 0)
    with pytest.raises(ConfigError, match=r"rows.jsonl', line 2 is"):
        load_eval_source(data(source="jsonl", path=write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}]),
                              eval_path=str(plain)), 0)


def test_a_file_that_cannot_be_read_names_it(tmp_path):
    """A .gz that is not gzip (BadGzipFile) and values nested past Python's recursion limit (RecursionError): raw
    errors from inside ``datasets`` before."""
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_bytes(b'{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match=r"fake.jsonl.gz' cannot be read as jsonl \(BadGzipFile: "):
        load_source(data(source="jsonl", path=str(fake)), 0)
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt": "a", "x": ' + "[" * 10000 + "]" * 10000 + "}\n")
    with pytest.raises(ConfigError, match=r"deep.jsonl' cannot be read as jsonl \(RecursionError: "):
        load_source(data(source="jsonl", path=str(deep)), 0)


# --------------------------------------------------------------------------- held-out data


def test_holdout_is_disjoint_seeded_and_independent_of_the_training_seed():
    cfg = data(source="arithmetic", arithmetic=ArithmeticTaskConfig(num_examples=100), eval_holdout=20)
    train, held = load_source(cfg, seed=0), load_eval_source(cfg, seed=0)
    assert len(train) == 80 and len(held) == 20
    key = lambda s: {s[i]["prompt"] for i in range(len(s))}  # noqa: E731
    assert not key(train) & key(held)
    assert key(load_eval_source(cfg, seed=7)) == key(held)  # train.seed does not move the split


def test_eval_path(tmp_path):
    cfg = data(source="jsonl", task="gsm8k", path=write_jsonl(tmp_path / "a.jsonl", GSM_ROWS),
               eval_path=write_jsonl(tmp_path / "b.jsonl", GSM_ROWS[:1]))
    assert len(load_source(cfg, 0)) == 3 and len(load_eval_source(cfg, 0)) == 1
    assert load_eval_source(data(), 0) is None


def test_eval_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="choose one source of held-out data"):
        load_config(None, None, ["data.source=jsonl", "data.path=x", "data.eval_path=y", "data.eval_holdout=5"])
    with pytest.raises(ConfigError, match="eval.every=5 needs held-out data"):
        load_config(None, None, ["eval.every=5"])
    with pytest.raises(ConfigError, match="eval_split='test' needs data.source='hub'"):
        load_config(None, None, ["data.source=jsonl", "data.path=x", "data.eval_split=test"])
    with pytest.raises(ConfigError, match="leaves no training data"):
        load_source(data(source="arithmetic", arithmetic=ArithmeticTaskConfig(num_examples=10), eval_holdout=10), 0)


def test_real_gsm8k_rows_with_holdout():
    """Real GSM8K rows: the loader splits them, and each held-out gold answer scores 1 against itself."""
    cfg = data(source="jsonl", path=str(GSM8K_HEAD), task="gsm8k", eval_holdout=10)
    train, held = load_source(cfg, 0), load_eval_source(cfg, 0)
    assert len(train) == 30 and len(held) == 10
    for item in held:
        final = item["answer"].split("####")[-1]
        assert math_correct(["p"], [f"<answer>{final}</answer>"], [item["answer"]]) == [1.0]
        assert math_correct(["p"], ["<answer>-1</answer>"], [item["answer"]]) == [0.0]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "garbled_footer"])
def test_a_corrupt_parquet_file_stops_with_its_name(tmp_path, damage):
    import pandas as pd

    good = tmp_path / "good.parquet"
    pd.DataFrame({"question": [f"q{i}" for i in range(200)], "answer": [str(i) for i in range(200)]}).to_parquet(good)
    b = good.read_bytes()
    bad = tmp_path / "bad.parquet"
    bad.write_bytes({"garbage": b"not parquet at all " * 8, "truncated": b[: len(b) // 2],
                     "garbled_footer": b[:8] + bytes(len(b) - 16) + b[-8:]}[damage])
    with pytest.raises(ConfigError, match=r"bad.parquet' is not a readable Parquet file.*corrupt or truncated"):
        load_source(data(source="parquet", path=str(bad), task="gsm8k"), 0)
    with pytest.raises(ConfigError, match=r"bad.parquet' is not a readable Parquet file"):  # held-out data alike
        load_eval_source(data(source="parquet", path=str(good), task="gsm8k", eval_path=str(bad)), 0)


@pytest.mark.timeout(120)  # before the bound, the generator drew forever
def test_countdown_with_too_many_numbers_stops_naming_the_setting():
    cfg = CountdownTaskConfig(num_examples=100, min_numbers=30, max_numbers=30)
    with pytest.raises(ConfigError, match=r"data.countdown.min_numbers=30 .*no solvable problem in 10000 random draws"
                                          r".*Lower data.countdown.min_numbers"):
        CountdownTask(cfg, seed=0)
    assert len(CountdownTask(CountdownTaskConfig(num_examples=20, min_numbers=12, max_numbers=12), seed=0)) == 20


def test_a_built_in_reward_and_a_trl_reward_share_one_mapped_dataset(tmp_path):
    """Issue 42, item 20: with the README's own ``answer: solution`` the column ``solution`` was gone, so a TRL
    reward reading it could not run beside math_correct reading ``answer``."""
    from grpo.foundation.config import RewardPoolConfig, RewardSpec
    from grpo.scoring.combined import CombinedReward

    path = write_jsonl(tmp_path / "s.jsonl", [{"question": "1+1?", "solution": "2"}])
    item = load_source(data(source="jsonl", path=path, columns={"prompt": "question", "answer": "solution"}), 0)[0]
    assert (item["prompt"], item["answer"], item["solution"]) == ("1+1?", "2", "2")
    r = CombinedReward([RewardSpec(fn="math_correct"), RewardSpec(fn="tests.reward_fixtures:trl_needs_solution")],
                       RewardPoolConfig(0, 10.0, 0))
    try:
        r.check_columns([c for c in item if c != "prompt"])
    finally:
        r.close()
