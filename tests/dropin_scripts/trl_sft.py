"""TRL's ``SFTTrainer`` as its ``sft`` script drives it: TRL's argument parser fills ``ScriptArguments``, ``SFTConfig``
and ``ModelConfig`` from the command line, the trainer gets the model as a path (so at ZeRO-3 transformers builds it
under ``deepspeed.zero.Init`` and loads the weights into the partitioned parameters) and loads the tokenizer from the
same directory. The DeepSpeed configuration comes only from the ACCELERATE_* variables that ``accelerate launch
--config_file <TRL's deepspeed_zero{2,3}.yaml>`` (or its torchrun translation) exports: no ``--deepspeed`` argument,
no ``optimizer`` section, so the Trainer builds its default optimizer and its warm-up scheduler.

Nothing is downloaded: ``make_model(path)`` writes a 2-layer Llama and a word-level tokenizer trained on the
in-memory corpus (run it once before the launch); the dataset is a ``datasets.Dataset`` built in memory.

Rank 0 writes to ``--out`` the per-step losses and learning rates the Trainer logs, the deepspeed module that ran,
the engine's ZeRO stage, and a digest of the weights ``save_model`` wrote (``<output_dir>/model.safetensors``)."""

import os
from dataclasses import dataclass, field

#: The corpus, tokenizer training text and dataset at once: short sentences over a small vocabulary.
SUBJECTS = ["the cat", "a dog", "my friend", "the robot", "our teacher", "the bird"]
VERBS = ["sees", "likes", "follows", "finds", "paints", "reads"]
OBJECTS = ["the red ball", "a small house", "the old book", "a green tree", "the quiet river", "a bright star"]


def corpus() -> list[str]:
    return [f"{s} {v} {o} and then {SUBJECTS[(i + j) % 6]} {VERBS[(i * j + 1) % 6]} {o} ."
            for i, s in enumerate(SUBJECTS) for j, v in enumerate(VERBS) for o in OBJECTS[j % 2::3]]


def make_model(path: str) -> None:
    """A word-level tokenizer trained on ``corpus()`` and a 2-layer Llama from a config, saved to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(corpus(), trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>",
                                      eos_token="<eos>")  # fmt: skip
    wrapped.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(wrapped), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=wrapped.pad_token_id, eos_token_id=wrapped.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)


@dataclass
class RecordArguments:
    out: str = field(metadata={"help": "rank 0 writes the record (JSON) here"})


def main(script_args, training_args, model_args, record_args):
    import datasets
    from safetensors.torch import load_file
    from trl import SFTTrainer

    from _common import write_result

    training_args.model_init_kwargs = {"dtype": model_args.dtype}
    rows = corpus()
    dataset = datasets.DatasetDict({script_args.dataset_train_split: datasets.Dataset.from_dict({"text": rows})})
    trainer = SFTTrainer(model=model_args.model_name_or_path, args=training_args,
                         train_dataset=dataset[script_args.dataset_train_split])  # fmt: skip
    trainer.train()
    trainer.save_model(training_args.output_dir)
    engine = trainer.model_wrapped
    logs = [h for h in trainer.state.log_history if "loss" in h]
    digest = None
    if int(os.environ.get("RANK", "0")) == 0:
        saved = load_file(os.path.join(training_args.output_dir, "model.safetensors"))
        initial = load_file(os.path.join(model_args.model_name_or_path, "model.safetensors"))
        digest = {k: [list(v.shape), str(v.dtype), float(v.double().sum()), float((v - initial[k]).abs().max())]
                  for k, v in sorted(saved.items())}
    write_result(record_args.out, [h["loss"] for h in logs], lrs=[h["learning_rate"] for h in logs],
                 engine=type(engine).__name__, stage=engine.zero_optimization_stage(),
                 optim=str(getattr(training_args.optim, "value", training_args.optim)), weights=digest,
                 accelerate_env={k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")
                                 and k != "ACCELERATE_DEBUG_RDZV_PORTS"})  # fmt: skip


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--make_model"]:
        make_model(sys.argv[2])
        sys.exit(0)
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, RecordArguments))
    main(*parser.parse_args_and_config())
