#!/usr/bin/env bash
# sd3-tiny at 128×128: batch 4 = microbatch 4 × accumulation 1 × 1 processes
# script: huggingface/diffusers v0.40.0 (d035dcd7cc7c88e0a154609b62887d50bba9fdc2) examples/dreambooth/train_dreambooth_lora_sd3.py
# note: the plan follows train_dreambooth_lora_sd3.py: gradient checkpointing is all blocks or none (transformer.enable_gradient_checkpointing()) (train_dreambooth_lora_sd3.py:1243-1244)
# note: the plan follows train_dreambooth_lora_sd3.py: no option stores the frozen base quantized (no NF4 / int8 flag in parse_args) (parse_args)
# note: the plan follows train_dreambooth_lora_sd3.py: --cache_latents casts the images to weight_dtype while the VAE stays fp32: under fp16/bf16 the VAE's conv fails (Input type and bias type should be the same), so latents are cached only with --mixed_precision no (train_dreambooth_lora_sd3.py:1237,1596-1599)
# note: the plan follows train_dreambooth_lora_sd3.py: with one --instance_prompt the text encoders are freed after encoding it once (train_dreambooth_lora_sd3.py:1559-1563)
# note: the plan follows train_dreambooth_lora_sd3.py: the LoRA adapters are upcast to fp32 only under fp16; under bf16 they, their gradients and AdamW's state stay bf16 (not yet modelled: the plan counts fp32 adapters, a few bytes per adapter parameter more than the run holds) (train_dreambooth_lora_sd3.py:1408-1413)
# note: --pretrained_model_name_or_path, --instance_data_dir, --instance_prompt, --output_dir and its data are placeholders: examples/dreambooth/train_dreambooth_lora_sd3.py (diffusers v0.40.0) trains on --instance_data_dir images with --instance_prompt; edit them
# note: LoRA targets (PEFT target_modules, sd3 module names): attn.add_k_proj, attn.add_q_proj, attn.add_v_proj, attn.to_add_out, attn.to_k, attn.to_out.0, attn.to_q, attn.to_v
# the script cannot: select xformers attention; diffusers' default processor calls PyTorch SDPA, which picks a memory-efficient kernel on CUDA by itself (train_dreambooth_lora_sd3.py has no --enable_xformers_memory_efficient_attention)
accelerate launch \
  --num_processes 1 \
  --num_machines 1 \
  --dynamo_backend no \
  --mixed_precision bf16 \
  train_dreambooth_lora_sd3.py \
  --pretrained_model_name_or_path stabilityai/stable-diffusion-3-medium-diffusers \
  --instance_data_dir ./instance_images \
  --instance_prompt 'a photo of sks subject' \
  --output_dir ./ditmem-out \
  --mixed_precision bf16 \
  --resolution 128 \
  --train_batch_size 4 \
  --gradient_accumulation_steps 1 \
  --allow_tf32 \
  --rank 4 \
  --lora_layers attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,attn.to_add_out,attn.to_k,attn.to_out.0,attn.to_q,attn.to_v
