// Loading, overriding, defaulting and validating the TrainConfig of a run
// (core/config.proto). Every binary that takes --config goes through LoadConfig,
// so a typo or an impossible combination is caught before any rank starts work,
// with a message that names the file position or the field and its value:
//
//   configs/x.textproto:12:3: unknown field 'lerning_rate' in smat.OptimizerConfig
//   --set optimizer.lr=fast: field 'lr': Expected double, got: fast
//   config: model.heads = 6 does not divide model.width = 384
//
//   SMAT_ASSIGN_OR_RETURN(TrainConfig cfg,
//                         LoadConfig("configs/tiny_cpu.textproto", {"optimizer.lr=3e-4"}));
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.pb.h"

namespace smat {

// Reads `path` (protobuf text format), applies `overrides` in order (each
// "path.to.field=value", as given to --set), fills defaults (ApplyDefaults) and
// validates (ValidateConfig). Errors: kNotFound (no file), kInvalidArgument
// (syntax, unknown field, wrong type, bad override, invalid value); messages
// start with "FILE:LINE:COL:" for errors in the file and "--set ..." for
// errors in an override.
absl::StatusOr<TrainConfig> LoadConfig(const std::string& path,
                                       const std::vector<std::string>& overrides = {});

// Parses text-format `text` into a config without defaults or validation;
// `source_name` prefixes error positions (a path, or e.g. "<inline>").
absl::StatusOr<TrainConfig> ParseConfigText(const std::string& text,
                                            const std::string& source_name);

// Applies one override "path.to.field=value" to `config`. The path must name a
// scalar or enum field; string values need no quotes (run.name=demo). On error
// `config` is unchanged. Example: ApplyOverride(cfg, "smat.d=3").
absl::Status ApplyOverride(TrainConfig& config, const std::string& override_text);

// Fills every unset optional field with the default written beside it in
// config.proto, and the derived defaults (head dims from width / heads,
// min_lr = lr / 10, total_steps = run.steps, run.dir, checkpoint.dir, job name).
// Idempotent; fields already set are never changed.
void ApplyDefaults(TrainConfig& config);

// Checks ranges and cross-field rules on `config` with defaults applied (the
// check works on a defaulted copy, so the caller need not apply them first).
// Reports every problem found, one per line, each naming the field and value.
absl::Status ValidateConfig(const TrainConfig& config);

// Text format of `config`, readable by LoadConfig (used for checkpoint
// manifests and to print the effective config at start-up).
std::string ConfigToText(const TrainConfig& config);

}  // namespace smat
