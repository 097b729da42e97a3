"""LoRA recovery of compressed models (Palu, Appendix; Eigen Attention): PEFT adapters on the latent
attention's projections, trained with the causal-LM loss, checkpointed so a killed run resumes, and merged
into the projections so the KV cache keeps its width and bytes.

    from lrkv_core.lora import RecoveryConfig, recover, training_data
    data = training_data("text:train.txt", tokenizer, seq_len=256)
    model, result = recover(compressed_model, data, RecoveryConfig(steps=200), checkpoint_dir="ckpt/")
    lrkv_core.save_compressed(model, "out/")

PEFT is imported only when adapters are attached.
"""

from .checkpoint import CheckpointMismatch, TrainState, latest_checkpoint
from .config import DEFAULT_TARGETS, ROLES, SCHEDULERS, RecoveryConfig
from .data import TrainingData, check_training_dataset, training_data
from .merge import check_latent_widths, merge_lora
from .recover import recover, recover_dir
from .targets import check_targets, target_modules
from .train import TrainResult, attach_lora, fit_lora, heldout_loss, train_lora

__all__ = [
    "DEFAULT_TARGETS",
    "ROLES",
    "SCHEDULERS",
    "CheckpointMismatch",
    "RecoveryConfig",
    "TrainResult",
    "TrainState",
    "TrainingData",
    "attach_lora",
    "check_latent_widths",
    "check_targets",
    "check_training_dataset",
    "fit_lora",
    "heldout_loss",
    "latest_checkpoint",
    "merge_lora",
    "recover",
    "recover_dir",
    "target_modules",
    "train_lora",
    "training_data",
]
