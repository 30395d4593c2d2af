// Configuration loading (core/config.h): text-format parsing with positioned
// errors, --set overrides, the one place defaults are applied, and validation.
#include "core/config.h"

#include <errno.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "core/geometry.h"
#include "core/status.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace smat {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

// Edit distance, for "did you mean" hints on misspelled field names.
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1u : 0u)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "unknown field 'x' in smat.M (did you mean 'y'?)" or "... (fields: a, b, c)".
std::string UnknownFieldMessage(const Descriptor* d, absl::string_view name) {
  std::string best;
  size_t best_distance = 3;  // suggest only close misspellings
  std::vector<std::string> names;
  for (int i = 0; i < d->field_count(); ++i) {
    const std::string& f = d->field(i)->name();
    names.push_back(f);
    const size_t dist = EditDistance(name, f);
    if (dist < best_distance) {
      best_distance = dist;
      best = f;
    }
  }
  std::string msg = absl::StrCat("unknown field '", name, "' in ", d->full_name());
  if (!best.empty()) return absl::StrCat(msg, " (did you mean '", best, "'?)");
  return absl::StrCat(msg, " (fields: ", absl::StrJoin(names, ", "), ")");
}

// Turns protobuf's parser messages into smat's wording where we know better.
//   Message type "smat.OptimizerConfig" has no field named "lerning_rate".
// becomes  unknown field 'lerning_rate' in smat.OptimizerConfig (...)
std::string RewriteParserMessage(const std::string& message) {
  static const std::string kPrefix = "Message type \"";
  static const std::string kMiddle = "\" has no field named \"";
  // The tokenizer's text at end of input is empty: say what that means.
  if (absl::EndsWith(message, "got: ")) {
    return absl::StrCat(message.substr(0, message.size() - 7),
                        " at end of file; is a closing '}' missing?");
  }
  if (absl::StartsWith(message, kPrefix)) {
    const size_t mid = message.find(kMiddle);
    if (mid != std::string::npos) {
      const std::string type = message.substr(kPrefix.size(), mid - kPrefix.size());
      const size_t name_start = mid + kMiddle.size();
      const size_t name_end = message.find('"', name_start);
      const Descriptor* d =
          google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(type);
      if (d != nullptr && name_end != std::string::npos) {
        return UnknownFieldMessage(d, message.substr(name_start, name_end - name_start));
      }
    }
  }
  return message;
}

// The identifier before the last ':' left of `column` on `line`: the field a
// value error belongs to ("width" in "  width: \"abc\""). Empty if none.
std::string FieldBefore(absl::string_view line, int column) {
  if (column < 0 || static_cast<size_t>(column) > line.size()) return "";
  absl::string_view left = line.substr(0, static_cast<size_t>(column));
  const size_t colon = left.rfind(':');
  if (colon == absl::string_view::npos) return "";
  size_t end = colon;
  while (end > 0 && absl::ascii_isspace(static_cast<unsigned char>(left[end - 1]))) --end;
  size_t start = end;
  while (start > 0 && (absl::ascii_isalnum(static_cast<unsigned char>(left[start - 1])) ||
                       left[start - 1] == '_')) {
    --start;
  }
  return std::string(left.substr(start, end - start));
}

// The unknown name in protobuf's "has no field named \"x\"" and "Unknown
// enumeration value of \"x\"" messages; empty for other messages.
std::string NameInMessage(const std::string& message) {
  for (const std::string& marker :
       {std::string("has no field named \""), std::string("Unknown enumeration value of \"")}) {
    const size_t at = message.find(marker);
    if (at == std::string::npos) continue;
    const size_t start = at + marker.size();
    const size_t end = message.find('"', start);
    if (end != std::string::npos) return message.substr(start, end - start);
  }
  return "";
}

// Collects the parser's errors as "SOURCE:LINE:COL: message" (1-based), naming
// the field for value errors whose protobuf wording does not.
class PositionedErrors : public google::protobuf::io::ErrorCollector {
 public:
  PositionedErrors(const std::string& source_name, const std::string& text)
      : source_name_(source_name), lines_(absl::StrSplit(text, '\n')) {}

  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    // protobuf reports unknown names after consuming them; point at their start.
    const std::string name = NameInMessage(message);
    if (!name.empty() && line >= 0 && static_cast<size_t>(line) < lines_.size()) {
      const size_t at = lines_[line].rfind(name, static_cast<size_t>(std::max(column, 0)));
      if (at != std::string::npos) column = static_cast<int>(at);
    }
    std::string msg = RewriteParserMessage(message);
    const bool names_field = msg.find("field") != std::string::npos;
    if (!names_field && line >= 0 && static_cast<size_t>(line) < lines_.size()) {
      const std::string field = FieldBefore(lines_[line], column);
      if (!field.empty()) msg = absl::StrCat("field '", field, "': ", msg);
    }
    errors_.push_back(absl::StrCat(source_name_, ":", line + 1, ":", column + 1, ": ", msg));
  }
  void AddWarning(int line, google::protobuf::io::ColumnNumber column,
                  const std::string& message) override {}

  std::string Joined() const { return absl::StrJoin(errors_, "\n"); }
  bool empty() const { return errors_.empty(); }

 private:
  std::string source_name_;
  std::vector<std::string> lines_;
  std::vector<std::string> errors_;
};

// Parses a whole config file. Parse (unlike Merge) refuses a field given twice,
// which in a file is almost always a copy-paste mistake.
absl::Status ParseText(const std::string& text, const std::string& source_name,
                       TrainConfig& config) {
  PositionedErrors errors(source_name, text);
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &config)) {
    if (errors.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(source_name, ": cannot parse config"));
    }
    return absl::InvalidArgumentError(errors.Joined());
  }
  return absl::OkStatus();
}

// A value usable unquoted in text format for a non-string field: a number,
// an enum name, true/false. Rejecting anything else keeps an override from
// smuggling extra fields in ("lr=1 } model { width: 3").
bool IsBareToken(absl::string_view v) {
  if (v.empty()) return false;
  for (char c : v) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '+' &&
        c != '-') {
      return false;
    }
  }
  return true;
}

// --- validation --------------------------------------------------------------------

class Checker {
 public:
  // Adds "config: <field> = <value> <problem>" unless ok.
  template <typename T>
  void Require(bool ok, absl::string_view field, const T& value, absl::string_view problem) {
    if (!ok) errors_.push_back(absl::StrCat("config: ", field, " = ", value, " ", problem));
  }
  void Add(std::string message) { errors_.push_back(absl::StrCat("config: ", message)); }
  absl::Status Result() const {
    if (errors_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrJoin(errors_, "\n"));
  }
  bool ok() const { return errors_.empty(); }

 private:
  std::vector<std::string> errors_;
};

std::string Quoted(const std::string& s) { return absl::StrCat("\"", absl::CEscape(s), "\""); }

void ValidateModel(const ModelConfig& m, Checker& c) {
  c.Require(m.vocab_size() >= 2, "model.vocab_size", m.vocab_size(), "must be at least 2");
  c.Require(m.width() >= 1, "model.width", m.width(), "must be at least 1");
  c.Require(m.layers() >= 1, "model.layers", m.layers(), "must be at least 1");
  c.Require(m.heads() >= 1, "model.heads", m.heads(), "must be at least 1");
  if (m.heads() >= 1 && m.width() >= 1 && m.width() % m.heads() != 0) {
    c.Add(absl::StrCat("model.heads = ", m.heads(), " does not divide model.width = ", m.width()));
  }
  c.Require(m.head_dim_qk() >= 1, "model.head_dim_qk", m.head_dim_qk(), "must be at least 1");
  c.Require(m.head_dim_v() >= 1, "model.head_dim_v", m.head_dim_v(), "must be at least 1");
  c.Require(m.mlp_hidden() >= 1, "model.mlp_hidden", m.mlp_hidden(), "must be at least 1");
  c.Require(m.recompute_above_t() >= 0, "model.recompute_above_t", m.recompute_above_t(),
            "must be >= 0 (0: never recompute)");
}

void ValidateParallel(const ParallelConfig& p, const MetricsConfig& metrics, Checker& c) {
  c.Require(p.dp() >= 1, "parallel.dp", p.dp(), "must be at least 1");
  c.Require(p.sp() >= 1, "parallel.sp", p.sp(), "must be at least 1");
  c.Require(p.collective_timeout_seconds() >= 1, "parallel.collective_timeout_seconds",
            p.collective_timeout_seconds(), "must be at least 1");
  c.Require(p.device() == "cpu" || p.device() == "cuda", "parallel.device", Quoted(p.device()),
            "is not a device; expected \"cpu\" or \"cuda\"");
  // 0: each rank lets the kernel pick a free port (trainer/metrics.h writes it down).
  c.Require(metrics.port() >= 0 && metrics.port() <= 65535, "metrics.port", metrics.port(),
            "is out of range; expected 1..65535, or 0 for a free port per rank");
  if (metrics.port() >= 1 && metrics.port() <= 65535 && p.dp() >= 1 && p.sp() >= 1 &&
      int64_t{metrics.port()} + int64_t{p.dp()} * p.sp() - 1 > 65535) {
    c.Add(absl::StrCat("metrics.port = ", metrics.port(),
                       " leaves no room for port + local_rank with ", int64_t{p.dp()} * p.sp(),
                       " ranks (the last port must be <= 65535)"));
  }
  c.Require(!metrics.host().empty(), "metrics.host", Quoted(metrics.host()), "must not be empty");
}

void ValidateSmatAndData(const TrainConfig& cfg, Checker& c) {
  const SmatConfig& s = cfg.smat();
  const DataConfig& d = cfg.data();
  const ParallelConfig& p = cfg.parallel();
  const bool d_ok = s.d() >= 1 && s.d() <= 8;
  c.Require(d_ok, "smat.d", s.d(), "is out of range; expected 1..8");
  const bool q_ok = s.q() == 0 || IsPrime(s.q());
  c.Require(q_ok, "smat.q", s.q(), "is not prime (0 picks q automatically)");
  c.Require(s.chunk() >= 1, "smat.chunk", s.chunk(), "must be at least 1");
  c.Require(s.eps() > 0 && std::isfinite(s.eps()), "smat.eps", s.eps(), "must be > 0");
  c.Require(s.decode_window() >= 0, "smat.decode_window", s.decode_window(),
            "must be >= 0 (0: fixed-horizon decoding)");

  c.Require(d.seq_len() >= 1, "data.seq_len", d.seq_len(), "must be at least 1");
  c.Require(d.batch_size() >= 1, "data.batch_size", d.batch_size(), "must be at least 1");
  c.Require(d.seed() >= 0, "data.seed", d.seed(), "must be >= 0");

  // Sequence-parallel spans are chunk-aligned, so each of the sp ranks needs at
  // least one whole chunk (ARCHITECTURE.md section 4).
  if (d.seq_len() >= 1 && s.chunk() >= 1 && p.sp() >= 1) {
    if (p.sp() > 1 && d.seq_len() % s.chunk() != 0) {
      c.Add(absl::StrCat(
          "data.seq_len = ", d.seq_len(), " is not a multiple of smat.chunk = ", s.chunk(),
          "; with parallel.sp = ", p.sp(), " the sequence is split into chunk-aligned spans"));
    }
    if (d.seq_len() / s.chunk() < p.sp()) {
      c.Add(absl::StrCat("data.seq_len = ", d.seq_len(), " has ", d.seq_len() / s.chunk(),
                         " chunks of smat.chunk = ", s.chunk(), ", fewer than parallel.sp = ",
                         p.sp(), " ranks; each sequence-parallel rank needs at least one chunk"));
    }
  }
  // The mask geometry must exist for this T (core/geometry.h: P <= n, q prime, ...).
  if (d_ok && q_ok && s.chunk() >= 1 && d.seq_len() >= 1) {
    auto plan = MakeSmatPlan(d.seq_len(), s.d(), s.chunk(), s.q());
    if (!plan.ok()) {
      c.Add(absl::StrCat("smat.d = ", s.d(), " (smat.q = ", s.q(), ", smat.chunk = ", s.chunk(),
                         ") does not fit data.seq_len = ", d.seq_len(), ": ",
                         plan.status().message()));
    }
  }

  switch (d.kind()) {
    case DataConfig::TEXT:
      if (d.path().empty()) {
        c.Add(
            "data.path is empty; data.kind = TEXT needs a token file (make one with "
            "smat_data bytes --input ... --output ...)");
      }
      if (cfg.run().eval_every() > 0 && d.heldout_path().empty()) {
        c.Add(absl::StrCat("run.eval_every = ", cfg.run().eval_every(),
                           " needs data.heldout_path for data.kind = TEXT (or set "
                           "run.eval_every = 0)"));
      }
      break;
    case DataConfig::MQAR:
    case DataConfig::MULTI_KEY: {
      const std::string kind = DataConfig::Kind_Name(d.kind());
      c.Require(d.num_pairs() >= 1, "data.num_pairs", d.num_pairs(), "must be at least 1");
      // Keys come from one half of the vocabulary and values from the other, and
      // the keys of one example are distinct (Zoology's MQAR generator).
      if (d.num_pairs() >= 1) {
        c.Require(d.vocab() >= 2 * int64_t{d.num_pairs()} + 2, "data.vocab", d.vocab(),
                  absl::StrCat("is too small for data.num_pairs = ", d.num_pairs(),
                               " distinct keys; need at least ", 2 * int64_t{d.num_pairs()} + 2));
      }
      if (d.kind() == DataConfig::MQAR) {
        // Pairs take 2 tokens each and leave at least as much room for queries.
        if (d.num_pairs() >= 1 && d.seq_len() >= 1 && 4 * int64_t{d.num_pairs()} > d.seq_len()) {
          c.Add(absl::StrCat("data.num_pairs = ", d.num_pairs(),
                             " does not fit data.seq_len = ", d.seq_len(),
                             " for data.kind = ", kind, "; need seq_len >= 4 * num_pairs"));
        }
      } else {
        // Mirrors CheckMultiKeySpec (trainer/data.h): the pairs (2 tokens each)
        // and the queries (k keys and k answers each) must fit one sequence.
        c.Require(d.keys_per_query() >= 1 && d.keys_per_query() <= d.num_pairs(),
                  "data.keys_per_query", d.keys_per_query(),
                  absl::StrCat("must be in [1, data.num_pairs = ", d.num_pairs(), "]"));
        c.Require(d.num_queries() >= 1, "data.num_queries", d.num_queries(), "must be at least 1");
        const int64_t need = 2 * int64_t{d.num_pairs()} +
                             2 * int64_t{d.keys_per_query()} * d.num_queries();
        if (d.seq_len() >= 1 && need > d.seq_len()) {
          c.Add(absl::StrCat("data.seq_len = ", d.seq_len(), " is too short for data.kind = ",
                             kind, ": 2 * num_pairs + 2 * keys_per_query * num_queries = ", need,
                             " tokens; raise seq_len or lower those"));
        }
      }
      if (d.vocab() > cfg.model().vocab_size()) {
        c.Add(absl::StrCat("data.vocab = ", d.vocab(), " exceeds model.vocab_size = ",
                           cfg.model().vocab_size(), " for data.kind = ", kind));
      }
      if (d.kind() != DataConfig::MQAR && d.layout() != DataConfig::UNIFORM) {
        c.Add(absl::StrCat("data.layout = ", DataConfig::Layout_Name(d.layout()),
                           " applies to data.kind = MQAR only; remove it"));
      }
      break;
    }
    case DataConfig::SUBSET_ROUTING: {
      // Mirrors CheckSubsetRoutingSpec (trainer/data.h).
      c.Require(d.landmarks() >= 1, "data.landmarks", d.landmarks(), "must be at least 1");
      c.Require(d.num_queries() >= 1, "data.num_queries", d.num_queries(), "must be at least 1");
      // Tokens 0-3 are filler, answer marker, select and skip; payloads need at
      // least two values to be random.
      c.Require(d.vocab() >= 6, "data.vocab", d.vocab(),
                "must be at least 6 for data.kind = SUBSET_ROUTING (4 control tokens, 2+ payloads)");
      const int64_t need = int64_t{d.landmarks()} + 2 * int64_t{d.landmarks()} * d.num_queries();
      if (d.seq_len() >= 1 && need > d.seq_len()) {
        c.Add(absl::StrCat("data.seq_len = ", d.seq_len(),
                           " is too short for data.kind = SUBSET_ROUTING: landmarks + 2 * "
                           "landmarks * num_queries = ",
                           need, " tokens; raise seq_len or lower those"));
      }
      if (d.vocab() > cfg.model().vocab_size()) {
        c.Add(absl::StrCat("data.vocab = ", d.vocab(), " exceeds model.vocab_size = ",
                           cfg.model().vocab_size(), " for data.kind = SUBSET_ROUTING"));
      }
      if (d.layout() != DataConfig::UNIFORM) {
        c.Add(absl::StrCat("data.layout = ", DataConfig::Layout_Name(d.layout()),
                           " applies to data.kind = MQAR only; remove it"));
      }
      break;
    }
    default: c.Add(absl::StrCat("data.kind = ", d.kind(), " is not a known kind"));
  }
}

void ValidateOptimizer(const OptimizerConfig& o, Checker& c) {
  c.Require(o.lr() > 0 && std::isfinite(o.lr()), "optimizer.lr", o.lr(), "must be > 0");
  c.Require(!(o.lr() > 0) || (o.min_lr() >= 0 && o.min_lr() <= o.lr()), "optimizer.min_lr",
            o.min_lr(), absl::StrCat("must be in [0, optimizer.lr = ", o.lr(), "]"));
  c.Require(o.total_steps() >= 1, "optimizer.total_steps", o.total_steps(), "must be at least 1");
  c.Require(o.warmup_steps() >= 0 && o.warmup_steps() <= o.total_steps(), "optimizer.warmup_steps",
            o.warmup_steps(),
            absl::StrCat("must be in [0, optimizer.total_steps = ", o.total_steps(), "]"));
  c.Require(o.weight_decay() >= 0, "optimizer.weight_decay", o.weight_decay(), "must be >= 0");
  c.Require(o.beta1() >= 0 && o.beta1() < 1, "optimizer.beta1", o.beta1(),
            "is out of range; expected [0, 1)");
  c.Require(o.beta2() >= 0 && o.beta2() < 1, "optimizer.beta2", o.beta2(),
            "is out of range; expected [0, 1)");
  c.Require(o.eps() > 0, "optimizer.eps", o.eps(), "must be > 0");
  c.Require(o.grad_clip() >= 0, "optimizer.grad_clip", o.grad_clip(),
            "must be >= 0 (0: no clipping)");
}

void ValidateRun(const TrainConfig& cfg, Checker& c) {
  const RunConfig& r = cfg.run();
  const bool name_ok =
      !r.name().empty() && std::all_of(r.name().begin(), r.name().end(), [](char ch) {
        return absl::ascii_isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' ||
               ch == '.';
      });
  c.Require(name_ok, "run.name", Quoted(r.name()),
            "must be non-empty letters, digits, '_', '-' or '.' (it names files and labels)");
  c.Require(r.steps() >= 1, "run.steps", r.steps(), "must be at least 1");
  c.Require(r.eval_every() >= 0, "run.eval_every", r.eval_every(), "must be >= 0 (0: never)");
  c.Require(r.log_every() >= 1, "run.log_every", r.log_every(), "must be at least 1");

  const CheckpointConfig& k = cfg.checkpoint();
  c.Require(k.every_steps() >= 0, "checkpoint.every_steps", k.every_steps(),
            "must be >= 0 (0: never save)");
  c.Require(k.keep_last() >= 1, "checkpoint.keep_last", k.keep_last(), "must be at least 1");
  c.Require(k.keep_every() >= 0, "checkpoint.keep_every", k.keep_every(),
            "must be >= 0 (0: keep only the newest)");
  c.Require(!k.resume().empty(), "checkpoint.resume", Quoted(k.resume()),
            "must be \"auto\", \"none\" or a checkpoint directory");
}

}  // namespace

absl::StatusOr<TrainConfig> ParseConfigText(const std::string& text,
                                            const std::string& source_name) {
  TrainConfig config;
  SMAT_RETURN_IF_ERROR(ParseText(text, source_name, config));
  return config;
}

absl::Status ApplyOverride(TrainConfig& config, const std::string& override_text) {
  const std::string where = absl::StrCat("--set ", override_text);
  const size_t eq = override_text.find('=');
  if (eq == std::string::npos || eq == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected path.to.field=value, e.g. optimizer.lr=3e-4"));
  }
  const std::string path(absl::StripAsciiWhitespace(override_text.substr(0, eq)));
  const std::string value(absl::StripAsciiWhitespace(override_text.substr(eq + 1)));
  const std::vector<std::string> parts = absl::StrSplit(path, '.');

  // Walk the path through the descriptors, so a bad path names the message it
  // was looked up in rather than failing inside the text parser.
  const Descriptor* d = TrainConfig::descriptor();
  const FieldDescriptor* field = nullptr;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": empty component in '", path, "'"));
    }
    field = d->FindFieldByName(parts[i]);
    if (field == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", UnknownFieldMessage(d, parts[i])));
    }
    const bool last = i + 1 == parts.size();
    const bool is_message = field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    if (!last && !is_message) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": '", parts[i], "' in ", d->full_name(),
                       " is a value, not a message; it has no field '", parts[i + 1], "'"));
    }
    if (last && is_message) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": '", path, "' is a message; set one of its fields, e.g. ", path,
                       ".", field->message_type()->field(0)->name(), "=..."));
    }
    if (is_message) d = field->message_type();
  }

  std::string literal;
  if (field->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
    // Quotes are optional on the command line; a quoted value is taken as written.
    const bool quoted = value.size() >= 2 && (value.front() == '"' || value.front() == '\'') &&
                        value.back() == value.front();
    literal = quoted ? Quoted(value.substr(1, value.size() - 2)) : Quoted(value);
  } else {
    if (!IsBareToken(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": value '", value, "' for ", path,
                       " is not a single number, enum name or true/false"));
    }
    literal = value;
  }
  std::string snippet = absl::StrCat(parts.back(), ": ", literal);
  for (size_t i = parts.size() - 1; i-- > 0;)
    snippet = absl::StrCat(parts[i], " { ", snippet, " }");

  // Parse into a copy so a bad value leaves `config` untouched. The parser sets
  // the field through reflection, so an explicit 0 or false does override.
  TrainConfig updated = config;
  PositionedErrors errors(where, snippet);
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.MergeFromString(snippet, &updated)) {
    std::string msg = errors.Joined();
    // The snippet is one line of our own making: its position adds nothing.
    const size_t colon = msg.find(": ", where.size() + 1);
    if (absl::StartsWith(msg, where) && colon != std::string::npos) {
      msg = absl::StrCat(where, ": ", msg.substr(colon + 2));
    }
    return absl::InvalidArgumentError(msg.empty() ? absl::StrCat(where, ": bad value") : msg);
  }
  config = std::move(updated);
  return absl::OkStatus();
}

void ApplyDefaults(TrainConfig& config) {
  ModelConfig& m = *config.mutable_model();
  if (!m.has_vocab_size()) m.set_vocab_size(256);
  if (!m.has_width()) m.set_width(256);
  if (!m.has_layers()) m.set_layers(4);
  if (!m.has_heads()) m.set_heads(4);
  const int32_t head_dim = m.heads() > 0 ? m.width() / m.heads() : 0;
  if (!m.has_head_dim_qk()) m.set_head_dim_qk(head_dim);
  if (!m.has_head_dim_v()) m.set_head_dim_v(head_dim);
  if (!m.has_mlp_hidden()) m.set_mlp_hidden(4 * m.width());
  if (!m.has_tied_embeddings()) m.set_tied_embeddings(true);

  SmatConfig& s = *config.mutable_smat();
  if (!s.has_d()) s.set_d(2);
  if (!s.has_chunk()) s.set_chunk(64);
  if (!s.has_eps()) s.set_eps(1e-6f);

  ParallelConfig& p = *config.mutable_parallel();
  if (!p.has_dp()) p.set_dp(1);
  if (!p.has_sp()) p.set_sp(1);
  if (!p.has_collective_timeout_seconds()) p.set_collective_timeout_seconds(300);
  if (!p.has_device()) p.set_device("cpu");

  DataConfig& d = *config.mutable_data();
  if (!d.has_seq_len()) d.set_seq_len(1024);
  if (!d.has_batch_size()) d.set_batch_size(8);
  if (!d.has_num_pairs()) d.set_num_pairs(64);
  if (!d.has_vocab()) d.set_vocab(8192);
  if (!d.has_keys_per_query()) d.set_keys_per_query(2);
  if (!d.has_num_queries()) d.set_num_queries(8);
  if (!d.has_landmarks()) d.set_landmarks(4);

  RunConfig& r = *config.mutable_run();
  if (!r.has_name()) r.set_name("smat");
  if (r.dir().empty()) r.set_dir(absl::StrCat("runs/", r.name()));
  if (!r.has_steps()) r.set_steps(1000);
  if (!r.has_log_every()) r.set_log_every(10);

  OptimizerConfig& o = *config.mutable_optimizer();
  if (!o.has_lr()) o.set_lr(3e-4f);
  if (!o.has_min_lr()) o.set_min_lr(o.lr() / 10);
  if (!o.has_weight_decay()) o.set_weight_decay(0.1f);
  if (!o.has_beta1()) o.set_beta1(0.9f);
  if (!o.has_beta2()) o.set_beta2(0.95f);
  if (!o.has_eps()) o.set_eps(1e-8f);
  if (!o.has_grad_clip()) o.set_grad_clip(1.0f);
  if (o.total_steps() == 0) o.set_total_steps(r.steps());

  CheckpointConfig& k = *config.mutable_checkpoint();
  if (k.dir().empty()) k.set_dir(absl::StrCat(r.dir(), "/checkpoints"));
  if (!k.has_every_steps()) k.set_every_steps(1000);
  if (!k.has_keep_last()) k.set_keep_last(3);
  if (!k.has_resume()) k.set_resume("auto");
  if (!k.has_async()) k.set_async(true);

  MetricsConfig& mt = *config.mutable_metrics();
  if (!mt.has_port()) mt.set_port(9400);
  if (!mt.has_host()) mt.set_host("0.0.0.0");
  if (mt.job_name().empty()) mt.set_job_name(r.name());
  if (!mt.has_enabled()) mt.set_enabled(true);
}

absl::Status ValidateConfig(const TrainConfig& config) {
  TrainConfig cfg = config;
  ApplyDefaults(cfg);
  Checker c;
  ValidateModel(cfg.model(), c);
  ValidateParallel(cfg.parallel(), cfg.metrics(), c);
  ValidateSmatAndData(cfg, c);
  ValidateOptimizer(cfg.optimizer(), c);
  ValidateRun(cfg, c);
  return c.Result();
}

absl::StatusOr<TrainConfig> LoadConfig(const std::string& path,
                                       const std::vector<std::string>& overrides) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: '", path, "' is a directory; give a .textproto file"));
  }
  std::ifstream in(path);
  if (!in) {
    const int err = errno;
    const std::string msg = absl::StrCat("config: cannot open '", path, "': ", std::strerror(err));
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
    return absl::InvalidArgumentError(msg);
  }
  std::stringstream text;
  text << in.rdbuf();
  SMAT_ASSIGN_OR_RETURN(TrainConfig config, ParseConfigText(text.str(), path));
  for (const std::string& o : overrides) SMAT_RETURN_IF_ERROR(ApplyOverride(config, o));
  ApplyDefaults(config);
  SMAT_RETURN_IF_ERROR(Annotate(ValidateConfig(config), path));
  return config;
}

std::string ConfigToText(const TrainConfig& config) {
  std::string out;
  google::protobuf::TextFormat::Printer printer;
  printer.PrintToString(config, &out);
  return out;
}

}  // namespace smat
