"""`deepspeed.utils.zero_to_fp32`: fp32 weights from a checkpoint folder (zerotrain/checkpoint/zero_to_fp32.py)."""

from zerotrain.checkpoint.zero_to_fp32 import (  # noqa: F401
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

if __name__ == "__main__":
    raise SystemExit(main())
