"""Axolotl plugin: the repository's per-step metrics (`cookbook.metrics.MetricsLogger`) for an `axolotl train` run.

    plugins:
      - cookbook_metrics.CookbookMetricsPlugin     # in the Axolotl YAML; this folder and shared/ on PYTHONPATH

It writes ``<output_dir>/metrics.jsonl`` with the same records as the recipes' ``train.py`` (one ``train`` record
per optimizer step, then a ``summary``), so `benchmarks/summarize.py` reads an Axolotl run like any other:
  * ``tokens_per_s_per_device``: the real (non-padding) tokens of the step's micro-batches, counted as
    ``attention_mask.sum()`` before each ``training_step`` (the count of ``recipes/unsloth-lora-ddp/train.py``),
    divided by the step's wall time (`time.perf_counter` between two ``on_step_end`` calls, after
    ``torch.cuda.synchronize``) and by the number of ranks. Axolotl's own ``tokens/train_per_sec_per_gpu``
    counts only the tokens with a label (the answers), so it is not the same number;
  * ``mem_allocated_gib`` / ``mem_reserved_gib``: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
    since training began (peaks reset at ``on_train_begin``), the largest over ranks;
  * ``loss``: the value ``training_step`` returns (the mean loss of the micro-batch), as in ``train.py``;
  * ``mfu``: `cookbook.metrics.ModelFlops` of the model with its adapters (all parameters but embeddings).
"""

from __future__ import annotations

import time

try:  # Axolotl's plugin base class; without Axolotl (tests) the plugin attaches to any HF Trainer
    from axolotl.integrations.base import BasePlugin
except ImportError:  # pragma: no cover - exercised in the main environment
    BasePlugin = object


class CookbookMetricsPlugin(BasePlugin):
    """Attach a `MetricsLogger` to the trainer that Axolotl builds (`post_trainer_create`)."""

    def post_trainer_create(self, cfg, trainer) -> None:
        """Count each micro-batch's real tokens and log one record per optimizer step to
        ``<trainer.args.output_dir>/metrics.jsonl``.

        Args:
            cfg: Axolotl's config (unused: everything comes from the trainer).
            trainer: a `transformers.Trainer` (Axolotl's ``AxolotlTrainer``) whose ``model`` has a ``config`` with
                ``num_hidden_layers``, ``num_attention_heads`` and ``hidden_size`` (``head_dim`` when present).
        """
        import torch
        from transformers import TrainerCallback

        from cookbook.dist import get_dist_info
        from cookbook.metrics import MetricsLogger, ModelFlops, count_parameters

        info = get_dist_info()
        model = trainer.model
        mc = model.config
        flops = ModelFlops(
            count_parameters(model),
            mc.num_hidden_layers,
            mc.num_attention_heads * getattr(mc, "head_dim", mc.hidden_size // mc.num_attention_heads),
        )
        metrics = MetricsLogger(
            trainer.args.output_dir,
            info,
            flops=flops,
            run_name="axolotl",
            mlflow=False,
            max_steps=trainer.args.max_steps,
            progress=False,
        )
        last_loss = {"value": torch.zeros(())}
        wall = {}

        class Metrics(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                metrics.start(state.global_step)
                wall["t0"] = time.perf_counter()

            def on_step_end(self, args, state, control, optimizer=None, **kw):
                lr = optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0
                metrics.log_step(state.global_step, last_loss["value"], lr, None)

            def on_train_end(self, args, state, control, **kw):
                metrics.log_summary(
                    {"step": state.global_step, "wall_s": time.perf_counter() - wall["t0"], "loader": "axolotl"}
                )
                metrics.close()

        step = trainer.training_step

        def training_step(model, inputs, *args, **kwargs):
            mask = inputs.get("attention_mask")
            # packed bins number their documents 1, 2, ... in the mask (0 = padding): count the non-zero entries
            tokens = (mask != 0).sum() if mask is not None else inputs["input_ids"].numel()
            metrics.add(samples=inputs["input_ids"].shape[0], tokens=tokens, data_wait_s=0.0)
            loss = step(model, inputs, *args, **kwargs)
            last_loss["value"] = loss.detach()
            return loss

        trainer.training_step = training_step
        trainer.add_callback(Metrics())
