"""What resume restores of the student, for comparing two runs' students in the tests."""

import torch


def trainable_state(student) -> dict[str, torch.Tensor]:
    """A CPU copy of the trainable weights: the adapter's with LoRA, else every weight (the state the
    trainer state saves and ``opdkit.setup.load_trainable_state`` loads)."""
    if hasattr(student, "merge_adapter"):
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(student).items()}
    return {k: v.detach().cpu() for k, v in student.state_dict().items()}
