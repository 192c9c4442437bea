#!/usr/bin/env bash
# flux-tiny at 128×128: batch 4 = microbatch 4 × accumulation 1 × 1 processes
# script: huggingface/diffusers v0.40.0 (d035dcd7cc7c88e0a154609b62887d50bba9fdc2) examples/dreambooth/train_dreambooth_lora_flux.py
# note: the plan follows train_dreambooth_lora_flux.py: gradient checkpointing is all blocks or none (transformer.enable_gradient_checkpointing()) (train_dreambooth_lora_flux.py:1249-1250)
# note: the plan follows train_dreambooth_lora_flux.py: no option stores the frozen base quantized (no NF4 / int8 flag in parse_args) (parse_args)
# note: the plan follows train_dreambooth_lora_flux.py: the text encoders stay on the device: `del text_encoder_one, text_encoder_two` leaves them in the `text_encoders` list, and each step re-encodes the batch's prompts with them (train_dreambooth_lora_flux.py:1492,1521,1738-1740)
# note: the plan follows train_dreambooth_lora_flux.py: the LoRA adapters are upcast to fp32 only under fp16; under bf16 they, their gradients and AdamW's state stay bf16 (not yet modelled: the plan counts fp32 adapters, a few bytes per adapter parameter more than the run holds) (train_dreambooth_lora_flux.py:1379-1384)
# note: --pretrained_model_name_or_path, --instance_data_dir, --instance_prompt, --output_dir and its data are placeholders: examples/dreambooth/train_dreambooth_lora_flux.py (diffusers v0.40.0) trains on --instance_data_dir images with --instance_prompt; edit them
# note: text encoders online: per-image captions (--caption_column) keep them on the device in weight_dtype and encode every batch; a fixed --instance_prompt is encoded once and the encoders freed (cached)
# note: LoRA targets (PEFT target_modules, flux module names): attn.to_k, attn.to_q, attn.to_v, attn.to_out.0, attn.add_k_proj, attn.add_q_proj, attn.add_v_proj, attn.to_add_out, ff.net.0.proj, ff.net.2, ff_context.net.0.proj, ff_context.net.2
# the script cannot: select xformers attention; diffusers' default processor calls PyTorch SDPA, which picks a memory-efficient kernel on CUDA by itself (train_dreambooth_lora_flux.py has no --enable_xformers_memory_efficient_attention)
accelerate launch \
  --num_processes 1 \
  --num_machines 1 \
  --dynamo_backend no \
  --mixed_precision bf16 \
  train_dreambooth_lora_flux.py \
  --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev \
  --instance_data_dir ./instance_images \
  --instance_prompt 'a photo of sks subject' \
  --output_dir ./ditmem-out \
  --mixed_precision bf16 \
  --resolution 128 \
  --train_batch_size 4 \
  --gradient_accumulation_steps 1 \
  --allow_tf32 \
  --rank 4 \
  --lora_layers attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2 \
  --cache_latents
