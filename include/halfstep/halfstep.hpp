// halfstep: everything, for users who want one include.
#pragma once

#include "halfstep/checkpoint.hpp"
#include "halfstep/config.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/error.hpp"
#include "halfstep/formats.hpp"
#include "halfstep/reference.hpp"
#include "halfstep/safetensors.hpp"
#include "halfstep/scaler.hpp"
#include "halfstep/spike.hpp"
#include "halfstep/state.hpp"
#include "halfstep/step.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/version.hpp"
