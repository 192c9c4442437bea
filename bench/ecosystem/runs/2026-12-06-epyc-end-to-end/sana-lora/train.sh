#!/usr/bin/env bash
# sana-tiny at 256×256: batch 4 = microbatch 1 × accumulation 4 × 1 processes
# script: huggingface/diffusers v0.40.0 (d035dcd7cc7c88e0a154609b62887d50bba9fdc2) examples/dreambooth/train_dreambooth_lora_sana.py
# note: the plan follows train_dreambooth_lora_sana.py: gradient checkpointing is all blocks or none (transformer.enable_gradient_checkpointing()) (train_dreambooth_lora_sana.py:1039-1040)
# note: the plan follows train_dreambooth_lora_sana.py: no option stores the frozen base quantized (no NF4 / int8 flag in parse_args) (parse_args)
# note: the plan follows train_dreambooth_lora_sana.py: Gemma-2 stays in the text-encoding pipeline (`del text_encoder` drops a name only), on the device unless --offload moves it back to the CPU after encoding (train_dreambooth_lora_sana.py:1031-1037,1222,1229-1230,1250)
# note: the plan follows train_dreambooth_lora_sana.py: the LoRA adapters are upcast to fp32 only under fp16; under bf16 they, their gradients and AdamW's state stay bf16 (not yet modelled: the plan counts fp32 adapters, a few bytes per adapter parameter more than the run holds) (train_dreambooth_lora_sana.py:1132-1135)
# note: --pretrained_model_name_or_path, --instance_data_dir, --instance_prompt, --output_dir and its data are placeholders: examples/dreambooth/train_dreambooth_lora_sana.py (diffusers v0.40.0) trains on --instance_data_dir images with --instance_prompt; edit them
# note: text encoders online: per-image captions (--caption_column) keep them on the device in weight_dtype and encode every batch; a fixed --instance_prompt is encoded once and the encoders freed (cached)
# note: LoRA targets (PEFT target_modules, sana module names): to_k, to_q, to_v
# the script cannot: select xformers attention; diffusers' default processor calls PyTorch SDPA, which picks a memory-efficient kernel on CUDA by itself (train_dreambooth_lora_sana.py has no --enable_xformers_memory_efficient_attention)
accelerate launch \
  --num_processes 1 \
  --num_machines 1 \
  --dynamo_backend no \
  --mixed_precision bf16 \
  train_dreambooth_lora_sana.py \
  --pretrained_model_name_or_path Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers \
  --instance_data_dir ./instance_images \
  --instance_prompt 'a photo of sks subject' \
  --output_dir ./ditmem-out \
  --mixed_precision bf16 \
  --resolution 256 \
  --train_batch_size 1 \
  --gradient_accumulation_steps 4 \
  --allow_tf32 \
  --rank 4 \
  --lora_layers to_k,to_q,to_v \
  --cache_latents
