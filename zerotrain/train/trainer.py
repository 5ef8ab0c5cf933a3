"""The training job behind `zerotrain train`: one loop, readable top to bottom.

    set up   tokenizer → model → data → engine config ("auto" filled) → engine
    resume   newest checkpoint in the run directory: weights, optimizer, RNG, data position
    loop     per step: micro-batches (forward, backward, step) → metrics every logging.interval
             → evaluation every eval_interval → checkpoint every save_interval → stop request?
    finish   final checkpoint, Hugging Face model directory, summary

Every rank runs this; rank 0 alone prints and writes files other than checkpoint shards.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerotrain
from zerotrain.checkpoint.hf_export import TOKENIZER_DIR
from zerotrain.checkpoint.saver import publish_latest
from zerotrain.comm.distributed import device_for, init_distributed
from zerotrain.comm.fault_points import fault_point
from zerotrain.profiling.device_peaks import peak_tflops
from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing
from zerotrain.runtime.chunked_loss import enable_chunked_loss
from zerotrain.runtime.compile import eager_for_counting
from zerotrain.train.evaluation import held_out_loss
from zerotrain.train.metrics import MetricsLog, describe_memory, gather_memory
from zerotrain.train.model import build_model, decay_groups, max_positions
from zerotrain.train.progress import TrainingProgress
from zerotrain.train.run_control import StopSignal, mark_started
from zerotrain.train.hang_watch import HangWatch
from zerotrain.train.memory_options import describe_memory_options
from zerotrain.train.run_state import RunState, plan_changes
from zerotrain.train.run_folder import checkpoint_tag, clear_interrupted_saves, resolve_resume, run_tags_up_to
from zerotrain.train.run_folder import tags_to_prune
from zerotrain.train.step_prediction import comparison, read_prediction
from zerotrain.train.stop_agreement import StopAgreement
from zerotrain.train.step_window import StepWindow, as_float, describe_step

log = logging.getLogger("zerotrain")
CHECKPOINTS = "checkpoints"
HF_DIR = "hf"


class Trainer:
    """Trains the model a TrainConfig describes; `run()` returns the summary."""

    def __init__(self, cfg: Any, resume: str = "never") -> None:
        from zerotrain.train.data import build_data, load_tokenizer
        from zerotrain.train.zero_fill import build_engine_config, wants_activation_offload, wants_gradient_checkpointing

        self.cfg = cfg
        launch = init_distributed()
        self.rank, self.world = launch.rank, launch.world_size
        self.device = device_for(launch.local_rank)
        self.run_dir = Path(cfg.output.dir)
        self.console = TrainingProgress.console()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.write(self.run_dir)
        self.stop = StopSignal(self.run_dir)
        torch.manual_seed(cfg.training.seed)

        self.tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        zero = cfg.zero_dict()
        zero_stage = int((zero.get("zero_optimization") or {}).get("stage", 0))
        self.model = build_model(cfg.model, self.tokenizer, zero_init=zero if zero_stage == 3 else None)
        self.checkpointing = wants_gradient_checkpointing(cfg)
        enable_gradient_checkpointing(self.model, self.checkpointing)
        if cfg.training.loss_chunk_tokens:
            enable_chunked_loss(self.model, cfg.training.loss_chunk_tokens)
        if cfg.training.tiled_mlp:  # true: DeepSpeed's tile count; a number: tokens per tile
            from zerotrain.runtime.tiled_mlp import enable_tiled_mlp
            enable_tiled_mlp(self.model, None if cfg.training.tiled_mlp is True else cfg.training.tiled_mlp)
        self.offload_activations = wants_activation_offload(cfg)
        if self.offload_activations:  # after checkpointing: it offloads the checkpointed layers' inputs
            from zerotrain.runtime.activation_offload import enable_activation_offload
            enable_activation_offload(self.model)
        t = cfg.training
        self.split = None  # sequence parallelism: a group's ranks read the same samples, each its slice
        if t.sequence_parallel_size > 1:
            from zerotrain.train.sequence_split import SequenceSplit, check_sequence_split
            check_sequence_split(cfg, self.world)  # before launch too; here for ranks started elsewhere
            self.split = SequenceSplit.start(t.sequence_parallel_size, bool(t.loss_chunk_tokens))
        self.data = build_data(
            cfg.data, self.tokenizer, max_positions=max_positions(self.model), evaluate=t.eval_interval > 0,
            **({"rank": self.split.data_rank, "world_size": self.split.data_world} if self.split else
               {"rank": self.rank, "world_size": self.world}))
        self.batches = self.data.train_batches(t.micro_batch_size, seed=cfg.data.seed)
        micro_per_epoch = len(self.batches)
        steps_per_epoch = max(1, micro_per_epoch // t.gradient_accumulation_steps)
        self.total_steps = t.max_steps or max(1, math.ceil(t.epochs * steps_per_epoch))
        engine_cfg, notes = build_engine_config(
            cfg, model=self.model, world_size=self.world, device_type=self.device.type, total_steps=self.total_steps
        )
        self.engine, *_ = zerotrain.initialize(
            model=self.model, model_parameters=decay_groups(self.model, t.weight_decay), config=engine_cfg
        )
        self.stop_agreement = StopAgreement(self.stop, self.world)  # a collective: here, where every rank is
        if self.rank == 0:
            for note in notes:
                log.warning(note)
        self.groups = self.world // t.sequence_parallel_size  # each sample's tokens counted once
        self.tokens_per_step = t.micro_batch_size * t.gradient_accumulation_steps * self.groups * cfg.data.seq_len
        self.state = RunState()
        self.last_save_step: int | None = None
        self.written_tags: list[str] = []  # tags output.keep_checkpoints may prune
        if resume == "auto" and self.rank == 0:
            removed = clear_interrupted_saves(self.run_dir / CHECKPOINTS)
            if removed:
                print(f"removed what interrupted saves left: {', '.join(removed)}", flush=True)
        resume_point = resolve_resume(resume, self.run_dir)
        if resume_point is not None:
            self._resume(resume_point)
        elif resume == "auto" and self.rank == 0:
            print(f"no checkpoint in {self.run_dir / CHECKPOINTS} yet: starting from step 0", flush=True)
        self.metrics = MetricsLog(
            cfg.logging, self.run_dir, rank=self.rank, world_size=self.world,
            resume_step=self.state.step, run_config=cfg.as_dict(),
        )
        self.peak = peak_tflops(self.device, self.engine.compute_dtype)
        self.flops_per_step: float | None = None  # this rank's, counted on the first micro-batch
        if self.state.flops.get("shape") == self._flops_shape():
            self.flops_per_step = self.state.flops.get("per_step")
        self.prediction = read_prediction(self.run_dir, self.world) if self.rank == 0 else None
        if self.rank == 0:
            mark_started(self.run_dir)  # every rank has built its engine: `--detach` may report started

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> dict:
        """Trains to the end, or until a stop request (Ctrl-C, SIGTERM, `zerotrain stop`); returns the summary."""
        self.stop.arm()
        try:
            return self._run()
        finally:
            self.stop.disarm()

    def _run(self) -> dict:
        t = self.cfg.training
        engine = self.engine
        engine.train()
        start = time.perf_counter()
        first_step = self.first_step = self.state.step
        window = StepWindow(self.state.step, start)
        last_loss = math.nan
        last_lr = self._lr()  # read with each metrics line: reading it every step settles fp16's step on the host
        last_eval: dict = self.metrics.earlier_eval()  # a resumed run that stops before its first evaluation
        stopped = False
        progress = TrainingProgress(self.rank == 0, self.cfg.logging.progress_bar, self.total_steps, first_step)
        # Said first: a model of the wrong size (a misread config) shows before any step is spent.
        unique = {id(p): p for p in self.engine.module.parameters()}.values()
        params = sum(getattr(p, "ds_numel", p.numel()) for p in unique)  # whole sizes at ZeRO-3
        ranks = f"{self.world} ranks" + (f" (sequence parallel {t.sequence_parallel_size} x data parallel "
                                         f"{self.groups})" if self.split else "")
        progress.note(f"model: {type(self.engine.module).__name__}, {params:,} parameters; {ranks}, "
                      f"{self.tokens_per_step:,} tokens per step, {self.total_steps} steps")
        progress.note(describe_memory_options(self.checkpointing, t.loss_chunk_tokens,
                                              self.engine.parsed_config.zero_optimization, t.tiled_mlp,
                                              self.offload_activations, t.sequence_parallel_size))
        self.hang = HangWatch(t.hang_timeout, self.rank, self.world)
        if self.hang.enabled:
            progress.note(f"hang timeout: {t.hang_timeout:g} s without progress stops the job and names the ranks "
                          "that did not arrive (training.hang_timeout)")
        tokens_per_s = math.nan
        if t.eval_interval and first_step == 0:
            last_eval = self._evaluate(start)  # the baseline the later evaluations improve on
            if last_eval:
                progress.note(f"step 0: eval loss {last_eval['eval_loss']:.4f}, ppl {last_eval['eval_ppl']:.2f}")
        with progress:
            while self.state.step < self.total_steps:
                step_loss = self._train_step(count_flops=self.flops_per_step is None)
                self.state.step += 1
                self.state.tokens += self.tokens_per_step
                window.add(step_loss)
                step = self.state.step
                if step % self.cfg.logging.interval == 0 or step == self.total_steps:
                    tokens_per_s = window.tokens_per_s(self.tokens_per_step)
                    last_loss, last_lr = self._log_train(window, start, progress), self._lr()
                    window = StepWindow(step, time.perf_counter())
                if t.eval_interval and (step % t.eval_interval == 0 or step == self.total_steps):
                    last_eval = self._evaluate(start) or last_eval
                    if last_eval:
                            progress.note(f"step {step}: eval loss {last_eval['eval_loss']:.4f}, ppl {last_eval['eval_ppl']:.2f}")
                stopped = self.stop_agreement.poll()  # no collective waited on in the step
                if stopped or (t.save_interval and step % t.save_interval == 0):
                    self._save(start)
                if stopped:
                    break
                fault_point("after_step", number=step)  # ZEROTRAIN_FAULT=after_step:all:N: a crash test
                progress.advance(step, last_loss, last_lr, tokens_per_s)
        self.stop_agreement.close()
        if not stopped and self.cfg.output.save_final and self.last_save_step != self.state.step:
            self._save(start)
        hf_dir = None
        if not stopped and self.cfg.output.export_hf:
            hf_dir = self._export_hf()
        elapsed = time.perf_counter() - start
        summary = {
            "status": "stopped" if stopped else "finished",
            "stopped_by": (self.stop.signal_name or "zerotrain stop") if stopped else None,
            "steps": self.state.step,
            "steps_this_run": self.state.step - first_step,
            "tokens": self.state.tokens,
            "wall_time_s": round(self.state.train_seconds + elapsed, 2),
            "mean_tokens_per_s": round((self.state.step - first_step) * self.tokens_per_step / max(elapsed, 1e-9), 1),
            "final_loss": last_loss,
            **last_eval,
            "run_dir": str(self.run_dir),
            "checkpoints": str(self.run_dir / CHECKPOINTS),
            "hf_model": str(hf_dir) if hf_dir else None,
            "metrics_csv": str(self.run_dir / "metrics.csv") if self.cfg.logging.csv else None,
        }
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            if stopped:
                self.stop.consume()
        self.metrics.close()
        self.hang.close()
        return summary

    def _train_step(self, count_flops: bool) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean loss."""
        engine = self.engine
        total = torch.zeros((), device=self.device)
        for micro in range(engine.gradient_accumulation_steps()):
            self.hang.at(self.state.step, "start")
            batch = next(self.batches)
            self.hang.at(self.state.step, "forward")
            if count_flops and micro == 0:
                from torch.utils.flop_counter import FlopCounterMode

                # Eager for this micro-batch (a compiled graph hides its FLOPs from the counter).
                with eager_for_counting(), FlopCounterMode(display=False) as counter:
                    loss = self._loss(batch)
                    engine.backward(loss)
                self.flops_per_step = float(counter.get_total_flops()) * engine.gradient_accumulation_steps()
            else:
                loss = self._loss(batch)
                self.hang.at(self.state.step, "backward")
                engine.backward(loss)
            self.hang.at(self.state.step, "optimizer_step")
            engine.step()
            total += loss.detach().float()
        return total / engine.gradient_accumulation_steps()

    def _loss(self, batch: dict) -> torch.Tensor:
        if self.split is not None:  # this rank's slice; the loss is its group's whole-sequence mean
            return self.split.train_loss(self.engine, batch, self.device)
        labels = batch["labels"].to(self.device, non_blocking=True)
        return self.engine(input_ids=batch["input_ids"].to(self.device, non_blocking=True), labels=labels).loss

    def _log_train(self, window: "StepWindow", start: float, progress: "TrainingProgress") -> float:
        loss = window.mean_loss(self.world)  # a collective: every rank
        memory = gather_memory(self.device, self.engine)
        seconds = max(time.perf_counter() - window.started, 1e-9)
        steps = self.state.step - window.first_step
        step_s = seconds / max(steps, 1)
        tflops = self.flops_per_step / step_s / 1e12 if self.flops_per_step else math.nan
        scaler = self.engine.loss_scaler
        row = {
            "step": self.state.step,
            "epoch": round(self.batches.epoch + self.batches.batch_in_epoch / len(self.batches), 4),
            "loss": loss,
            "lr": self._lr(),
            "grad_norm": as_float(self.engine.get_global_grad_norm()),
            "loss_scale": scaler.loss_scale if scaler is not None else math.nan,
            "skipped_steps": self.engine.skipped_steps,
            "samples_per_s": steps * self.engine.train_batch_size() / seconds,
            "tokens_per_s": steps * self.tokens_per_step / seconds,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak else math.nan,
            "elapsed_s": self.state.train_seconds + time.perf_counter() - start,
        }
        if self.prediction is not None and window.first_step > self.first_step:  # not the warm-up window
            progress.note(comparison(step_s, self.prediction))
            self.prediction = None  # said once
        for r, rank_memory in enumerate(memory):
            row.update(rank_memory.columns(r))
        self.metrics.log_train(row)
        progress.note(describe_step(row, describe_memory(memory, self.device.type), fp16=scaler is not None))
        return loss

    # --- evaluation ------------------------------------------------------------------------

    def _evaluate(self, start: float) -> dict:
        """Token-weighted loss and perplexity over the held-out split, across every rank."""
        batches = self.data.eval_batches(self.cfg.training.micro_batch_size, self.cfg.training.eval_batches)
        if batches is None:
            return {}
        eval_loss = held_out_loss(self.engine, batches, self.device, self.split,
                                  lambda: self.hang.at(self.state.step, "start"))
        row = {"step": self.state.step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0)),
               "elapsed_s": self.state.train_seconds + time.perf_counter() - start}
        self.metrics.log_eval(row)
        return {"eval_step": row["step"], "eval_loss": row["eval_loss"], "eval_ppl": row["eval_ppl"]}

    # --- checkpoints, stop, export ------------------------------------------------------------

    def _save(self, start: float) -> None:
        checkpoints = self.run_dir / CHECKPOINTS
        state = RunState(self.state.step, self.state.tokens,
                         self.state.train_seconds + time.perf_counter() - start, self.batches.state_dict(),
                         **self._plan(), flops={"per_step": self.flops_per_step, "shape": self._flops_shape()})
        tag = checkpoint_tag(state.step)
        self.engine.save_checkpoint(checkpoints, tag=tag, client_state={"run_state": state.__dict__})
        self.last_save_step = state.step
        if tag in self.written_tags:
            self.written_tags.remove(tag)
        self.written_tags.append(tag)
        if self.rank != 0:
            return
        if not (checkpoints / TOKENIZER_DIR).is_dir():
            # `zerotrain consolidate --hf` on these checkpoints writes the run's real tokenizer.
            self.tokenizer.save_pretrained(checkpoints / TOKENIZER_DIR)
        self._prune(checkpoints)

    def _prune(self, checkpoints: Path) -> None:
        keep = self.cfg.output.keep_checkpoints
        if keep:
            for old in tags_to_prune(checkpoints, self.written_tags, keep):
                shutil.rmtree(checkpoints / old, ignore_errors=True)
                self.written_tags.remove(old)

    def _flops_shape(self) -> list:
        t = self.cfg.training
        shape = [self.world, t.micro_batch_size, t.gradient_accumulation_steps, self.cfg.data.seq_len]
        return shape + [t.sequence_parallel_size] if self.split else shape  # a rank's FLOPs shrink with N

    def _plan(self) -> dict:
        sched = self.engine.parsed_config.scheduler
        schedule = {"type": sched.type, "params": dict(sched.params)} if sched is not None else {}
        return {"global_batch": self.engine.train_batch_size(), "total_steps": self.total_steps,
                "schedule": json.loads(json.dumps(schedule, default=str))}

    def _resume(self, point) -> None:
        if point.deepspeed is not None:  # a DeepSpeed run's checkpoint (--resume-from)
            from zerotrain.train.deepspeed_start import continue_deepspeed_run

            path, self.state = continue_deepspeed_run(self.engine, self.batches, point, self.cfg.data.seq_len)
            if self.rank == 0:
                print(f"resumed from DeepSpeed's {path} at step {self.state.step}; the data continues after "
                      f"{self.engine.global_samples} samples (epoch {self.batches.epoch})", flush=True)
            return
        path, client = self.engine.load_checkpoint(point.load_dir, tag=point.tag)
        saved = (client or {}).get("run_state") or {}
        self.state = RunState(**saved)
        self.batches.load_state_dict(self.state.data)
        self.last_save_step = self.state.step
        own = point.load_dir.resolve() == (self.run_dir / CHECKPOINTS).resolve()
        if own:
            # This run's own earlier checkpoints, up to the one resumed from, are its to prune.
            self.written_tags = run_tags_up_to(point.load_dir, self.state.step)
        if own and point.tag is not None and self.rank == 0:
            # A tag newer than `latest` (its save was killed before moving it): finish that save's work.
            publish_latest(point.load_dir, point.tag)
            self._prune(point.load_dir)
        if self.rank == 0:
            why = "" if point.tag is None else " (newer than `latest`: its save was cut before moving it)"
            print(f"resumed from {path} at step {self.state.step}{why}", flush=True)
            for change in plan_changes(saved, self._plan()):
                log.warning("resumed with a different %s", change)

    def _export_hf(self) -> Path | None:
        out = self.run_dir / HF_DIR
        if self.rank == 0:
            from zerotrain.checkpoint.hf_export import export_hf

            export_hf(self.run_dir / CHECKPOINTS, out)
            self.tokenizer.save_pretrained(out)
        if self.world > 1:
            dist.barrier()
        return out

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])
