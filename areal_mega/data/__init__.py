"""Prompt datasets for RL: jsonl / parquet files and offline reasoning-gym tasks.

    split = load_dataset(DatasetConfig(kind="reasoning_gym", tasks=["basic_arithmetic"], size=500,
                                       num_eval=50, seed=1))
    for sample in split.train: ...        # one shuffled epoch; iterate again for the next
    sample == {"id": "basic_arithmetic/17", "question": "Calculate 5 - 3.", "answer": "2",
               "prompt": "Question: Calculate 5 - 3.\\nAnswer:", ...extra fields}

``prompt`` is the text the workflow tokenises: the question formatted by ``template``
("plain": "Question: ...\\nAnswer:", works with any tokenizer; "chat": the tokenizer's chat
template, needs ``tokenizer``; "raw": the question as is). ``answer`` is what the reward
compares against. Everything is deterministic given ``seed``.
"""

from areal_mega.data.dataset import (DatasetConfig, DatasetSplit, PromptDataset, PromptStream, build_prompt_source,
                                     format_prompt, listed_source, load_dataset)

__all__ = ["DatasetConfig", "DatasetSplit", "PromptDataset", "build_prompt_source", "listed_source", "PromptStream", "format_prompt", "load_dataset"]
