"""A model's (or tokenizer's) folder as mlx-lm loads its tokenizer: the text corpus's tokenizer
(datasets.py) and the JSONL records' chat template (jsonl.py) come from it."""

from pathlib import Path

from ..options import ConfigError

# Files a tokenizer is read from (transformers' AutoTokenizer): a folder with none of them has none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def hf_tokenizer(folder: Path):
    """mlx-lm's tokenizer of a model (or tokenizer) folder, or one ConfigError line naming the folder
    and what it lacks, instead of the traceback transformers raises."""
    from mlx_lm.utils import load_tokenizer
    folder = Path(folder)
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    fix = "copy the tokenizer's files in from where the model came from, or pass --tokenizer FOLDER"
    if not present:
        raise ConfigError(f"{folder} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there; {fix}")
    try:
        return load_tokenizer(folder)
    except Exception as e:  # transformers raises ValueError, OSError, KeyError... for a tokenizer it cannot build
        why = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"cannot load the tokenizer in {folder} from its {', '.join(present)} "
                          f"({type(e).__name__}: {why}); {fix}") from None
