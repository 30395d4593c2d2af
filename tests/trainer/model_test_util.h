// Shared by the model tests (model_test.cc, one process; model_mpi_test.cc,
// under mpirun): a tiny config, random parameters and a random batch.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.pb.h"
#include "core/rng.h"
#include "core/status.h"
#include "trainer/model.h"

namespace smat {

struct TinyModelOptions {
  int d = 2;
  bool token_hash = false;
  bool gated = false;
  bool short_conv = false;
  bool key_gate = false;
  bool tied = true;
  int64_t T = 37;  // 9 chunks of 4 and a partial one
  int64_t recompute_above_t = 0;
  ModelConfig::FeatureMap feature_map = ModelConfig::ELU_PLUS_ONE;
};

// vocab 13, width 8, 2 heads of r = dv = 4, MLP 12, 2 layers, chunk 4.
inline TrainConfig TinyModelConfig(const TinyModelOptions& o) {
  TrainConfig c;
  ModelConfig* m = c.mutable_model();
  m->set_vocab_size(13);
  m->set_width(8);
  m->set_heads(2);
  m->set_mlp_hidden(12);
  m->set_layers(2);
  m->set_tied_embeddings(o.tied);
  m->set_short_conv(o.short_conv);
  m->set_gated(o.gated);
  m->set_key_gate(o.key_gate);
  m->set_routing(o.token_hash ? ModelConfig::TOKEN_HASH : ModelConfig::POSITIONAL);
  m->set_recompute_above_t(o.recompute_above_t);
  m->set_feature_map(o.feature_map);
  c.mutable_smat()->set_d(o.d);
  c.mutable_smat()->set_chunk(4);
  c.mutable_data()->set_seq_len(o.T);
  c.mutable_run()->set_seed(5);
  return c;
}

// Replaces the initial parameters by O(1) random values, so every term of the
// gradient (gates, conv taps, biases) is far from its initial near-identity.
inline void RandomizeParameters(Model& model, uint64_t seed) {
  auto& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter& p = params[i];
    const bool is_norm = p.name.find("norm") != std::string::npos;
    SMAT_CHECK(FillNormal(p.value, seed, 0, is_norm ? 1.f : 0.f, 0.5f, 1000 + i).ok());
  }
}

// tokens, targets in [0, vocab); about one loss weight in five is 0.
inline ModelInputs RandomModelInputs(int64_t batch, int64_t T, int64_t vocab, uint64_t seed) {
  ModelInputs in;
  in.tokens = *Tensor::Empty({batch, T}, DType::kI32);
  in.targets = *Tensor::Empty({batch, T}, DType::kI32);
  in.loss_mask = *Tensor::Empty({batch, T}, DType::kF32);
  SMAT_CHECK(FillUniformInt(in.tokens, seed, 0, 0, vocab, 1).ok());
  SMAT_CHECK(FillUniformInt(in.targets, seed, 0, 0, vocab, 2).ok());
  SMAT_CHECK(FillUniform(in.loss_mask, seed, 0, 0.f, 1.f, 3).ok());
  float* w = in.loss_mask.data<float>();
  for (int64_t i = 0; i < batch * T; ++i) w[i] = w[i] < 0.2f ? 0.f : 1.f;
  return in;
}

}  // namespace smat
