# Sourced by the benchmark scripts: MODEL_DIR="$OUT/model" holding the tokenizer files of $TOKENIZER_DIR
# and $MODEL_CONFIG as config.json, for a run with model.pretrained=false (random init from the config).
MODEL_DIR="$OUT/model"
mkdir -p "$MODEL_DIR"
cp "$TOKENIZER_DIR"/* "$MODEL_DIR/"
cp "$MODEL_CONFIG" "$MODEL_DIR/config.json"  # after the tokenizer files, in case their folder has a config.json
