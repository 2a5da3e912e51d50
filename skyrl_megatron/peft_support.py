"""The file names of an HF `peft` adapter directory: what our export writes (`model/adapters/lora.py`,
`checkpoint/hf_export.py`) and our engine reads (`engines/lora_merge.py`).

Free of imports: config checks and the export read them without loading peft or torch.
"""

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
