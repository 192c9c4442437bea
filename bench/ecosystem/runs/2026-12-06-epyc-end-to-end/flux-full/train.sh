#!/usr/bin/env bash
# flux-tiny-full at 128×128: batch 4 = microbatch 4 × accumulation 1 × 1 processes
# script: huggingface/diffusers v0.40.0 (d035dcd7cc7c88e0a154609b62887d50bba9fdc2) examples/dreambooth/train_dreambooth_flux.py
# note: the plan follows train_dreambooth_flux.py: gradient checkpointing is all blocks or none (transformer.enable_gradient_checkpointing()) (train_dreambooth_flux.py:1212-1213)
# note: the plan follows train_dreambooth_flux.py: no option stores the frozen base quantized (no NF4 / int8 flag in parse_args) (parse_args)
# note: the plan follows train_dreambooth_flux.py: no --cache_latents: the VAE encodes every step (train_dreambooth_flux.py:1575,1607)
# note: the plan follows train_dreambooth_flux.py: with one --instance_prompt the text encoders are freed after encoding it once (train_dreambooth_flux.py:1411-1418)
# note: --pretrained_model_name_or_path, --instance_data_dir, --instance_prompt, --output_dir and its data are placeholders: examples/dreambooth/train_dreambooth_flux.py (diffusers v0.40.0) trains on --instance_data_dir images with --instance_prompt; edit them
# the script cannot: select xformers attention; diffusers' default processor calls PyTorch SDPA, which picks a memory-efficient kernel on CUDA by itself (train_dreambooth_flux.py has no --enable_xformers_memory_efficient_attention)
accelerate launch \
  --num_processes 1 \
  --num_machines 1 \
  --dynamo_backend no \
  --mixed_precision bf16 \
  train_dreambooth_flux.py \
  --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev \
  --instance_data_dir ./instance_images \
  --instance_prompt 'a photo of sks subject' \
  --output_dir ./ditmem-out \
  --mixed_precision bf16 \
  --resolution 128 \
  --train_batch_size 4 \
  --gradient_accumulation_steps 1 \
  --allow_tf32
